"""LLaMA: the GPT decoder with RMSNorm, SwiGLU, rotary embeddings, no biases, untied output."""
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

LLAMA_DEFAULTS = dict(
    normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
    position_embedding_type="rope", attention_dropout=0.0, hidden_dropout=0.0,
    layernorm_epsilon=1e-5,
)


def llama_config(**overrides) -> TransformerConfig:
    """A TransformerConfig with LLaMA's architecture choices; ``overrides`` set the sizes."""
    return TransformerConfig(**{**LLAMA_DEFAULTS, **overrides})


class LlamaModel(GPTModel):
    def __init__(self, config: TransformerConfig, vocab_size: int, **kwargs):
        kwargs.setdefault("share_embeddings_and_output_weights", False)
        super().__init__(config, vocab_size, **kwargs)
