"""Everything that shapes a transformer, in one dataclass (Megatron-core's TransformerConfig)."""
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.core.fp8.config import Fp8Config
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel.layer_split import stage_layer_counts
from megatron.core.transformer.gated_linear_unit import GATED_ACTIVATIONS
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.sliding_window import check_window

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "gelu_tanh") + GATED_ACTIVATIONS
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
ROPE_TYPES = ("rope", "yarn")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")


@dataclass
class TransformerConfig(ModelParallelConfig):
    num_layers: int = 1
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size
    # Grouped-query attention: key/value heads shared by groups of query heads (None = MHA).
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None  # per-head dimension; default hidden / heads
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu"  # gelu (exact), gelu_tanh (GPT-2's), swiglu (LLaMA's)
    # or quick_geglu (gpt-oss's gate * sigmoid(1.702 gate))
    # Gated activations only (gated_linear_unit.py): added to the up half before the product
    # (gpt-oss: 1), and the clamp of both halves (gate from above, up both sides; gpt-oss: 7).
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    add_bias_linear: bool = True
    add_qkv_bias: Optional[bool] = None  # default add_bias_linear
    # config.normalization over each query and key head's dim before RoPE (Qwen3's q/k_norm).
    qk_layernorm: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: int = 2048
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    # LLaMA-3 style frequency scaling of the rotary embedding (None = off).
    rope_scaling_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    # "yarn": YaRN rotary scaling (gpt-oss, DeepSeek-V3, long-context Qwen), with the
    # parameters below, named as Megatron's MLA config names them. Not with LLaMA-3 scaling.
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # Floor/ceil the correction range to whole dims (HF's "truncate"; gpt-oss: False).
    yarn_truncate: bool = True
    # The cos/sin multiplier; None derives it from the factor and mscale(s), as HF does.
    yarn_attention_factor: Optional[float] = None
    init_method_std: float = 0.02
    # Scale the init of output projections by 1/sqrt(2 * num_layers) (GPT-2 / Megatron).
    scaled_output_init: bool = True
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: bool = False
    # Uneven pipelines: layers on the first / last stage (None = an even share).
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    # Or balance the ends by counting the embedding / the output layer + loss as one layer.
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # torch.compile each layer's element-wise regions (norm + residual, activation, RoPE), not
    # the GEMMs, attention or TP collectives (--torch-compile).
    torch_compile: bool = False
    # Mixture of experts in place of the MLP of the layers moe.moe_layer_freq picks (None =
    # dense everywhere).
    moe: Optional[MoEConfig] = None
    # FP8 GEMMs in the transformer layers' linears (None: high precision; the embedding and
    # the output layer always are).
    fp8: Optional[Fp8Config] = None
    # Sliding-window attention (left, right): query i sees keys i - left .. i (right must be
    # 0); every window_attn_skip_freq-th layer keeps full attention (sliding_window.py).
    window_size: Optional[Tuple[int, int]] = None
    window_attn_skip_freq: Optional[int] = None
    # The softmax over keys (Megatron's --softmax-type): "vanilla"; "learnable" adds a learned
    # logit per head to the denominator (gpt-oss's attention sinks); "off-by-one" a fixed 0.
    softmax_type: str = "vanilla"
    # Multi-latent attention (DeepSeek-V2/V3, multi_latent_attention.py; Megatron's names and
    # defaults): queries from the hidden states (or through a q_lora_rank latent), keys and
    # values from one kv_lora_rank latent per token; a query/key head has qk_head_dim channels
    # without position and qk_pos_emb_head_dim rotated ones (the key's shared by all heads),
    # a value head v_head_dim. qk_layernorm then means the latents' norms (Megatron's).
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None  # None: queries straight from the hidden states
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE on adjacent channel pairs (x0, x1), (x2, x3), ... (DeepSeek's checkpoints, HF's
    # rope_interleave) instead of the two halves; multi-latent attention only.
    rotary_interleaved: bool = False
    # Multi-token prediction (DeepSeek-V3): D modules after the model predicting 1..D tokens
    # further, their mean losses times mtp_loss_scaling_factor / D added to the loss.
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1
    # QK-clip (MuonClip, Kimi K2; Megatron's names): after each optimizer step, each head whose
    # largest pre-softmax logit of the step passed qk_clip_threshold has its query rows scaled
    # by gamma^qk_clip_alpha and its key rows by gamma^(1 - alpha), gamma = threshold / max
    # (optimizer/qk_clip.py). log_max_attention_logit records the max without clipping.
    qk_clip: bool = False
    qk_clip_threshold: float = 100.0
    qk_clip_alpha: float = 0.5
    log_max_attention_logit: bool = False

    def __post_init__(self):
        def need(cond, message):
            if not cond:
                raise ValueError(f"TransformerConfig: {message}")

        super().__post_init__()
        # Sizes first: the rules below divide by them, and a negative one fails only later,
        # as a "negative dimension" deep in a layer.
        for name in ("num_layers", "hidden_size", "num_attention_heads",
                     "max_position_embeddings"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("ffn_hidden_size", "kv_channels", "num_query_groups"):
            value = getattr(self, name)
            need(value is None or value >= 1, f"{name} must be >= 1 (or None), got {value}.")
        for name in ("attention_dropout", "hidden_dropout"):
            need(0.0 <= getattr(self, name) < 1.0,
                 f"{name} must be in [0, 1), got {getattr(self, name)}.")
        try:  # fail here, before any process talks to another, if the layers cannot split
            stage_layer_counts(self.num_layers, self.pipeline_model_parallel_size,
                               self.num_layers_in_first_pipeline_stage,
                               self.num_layers_in_last_pipeline_stage,
                               self.virtual_pipeline_model_parallel_size,
                               self.account_for_embedding_in_pipeline_split,
                               self.account_for_loss_in_pipeline_split)
        except ValueError as exc:
            need(False, str(exc))
        if self.window_size is not None:
            try:
                check_window(self.window_size)
            except ValueError as exc:
                need(False, str(exc))
        if self.mtp_num_layers is not None:
            need(self.mtp_num_layers >= 1,
                 f"mtp_num_layers must be >= 1 (or None), got {self.mtp_num_layers}.")
            need(self.pipeline_model_parallel_size == 1 or
                 self.position_embedding_type != "learned_absolute",
                 "multi-token prediction under pipeline parallelism looks the tokens up on the "
                 "last stage, which has no copy of the learned position embeddings: use "
                 "--position-embedding-type rope (or none), or --pipeline-model-parallel-size "
                 "1.")
        need(self.window_attn_skip_freq is None or self.window_attn_skip_freq >= 1,
             f"window_attn_skip_freq must be >= 1, got {self.window_attn_skip_freq}.")
        if self.multi_latent_attention:  # before the kv_channels default: it sets its own
            self._check_latent_attention(need)
        need(not self.rotary_interleaved or self.multi_latent_attention,
             "rotary_interleaved (--rotary-interleaved) is implemented for multi-latent "
             "attention only; add --multi-latent-attention or drop it.")
        if self.kv_channels is None:
            need(self.hidden_size % self.num_attention_heads == 0,
                 f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                 f"{self.num_attention_heads}; change one of them or set kv_channels.")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        need(self.num_attention_heads % self.num_query_groups == 0,
             f"num_attention_heads {self.num_attention_heads} is not divisible by "
             f"num_query_groups {self.num_query_groups}.")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.add_qkv_bias is None:
            self.add_qkv_bias = self.add_bias_linear
        need(self.normalization in NORMALIZATIONS,
             f"normalization {self.normalization!r} not in {NORMALIZATIONS}.")
        need(self.softmax_type in SOFTMAX_TYPES,
             f"softmax_type {self.softmax_type!r} not in {SOFTMAX_TYPES}.")
        need(self.activation in ACTIVATIONS, f"activation {self.activation!r} not in {ACTIVATIONS}.")
        self._check_glu(need)
        need(self.position_embedding_type in POSITION_EMBEDDINGS,
             f"position_embedding_type {self.position_embedding_type!r} not in "
             f"{POSITION_EMBEDDINGS}.")
        need(0.0 < self.rotary_percent <= 1.0, "rotary_percent must be in (0, 1].")
        need(self.rope_type in ROPE_TYPES,
             f"rope_type {self.rope_type!r} not in {ROPE_TYPES} (--rope-type).")
        if self.rope_type == "yarn":
            self._check_yarn(need)
        need(self.recompute_granularity in RECOMPUTE_GRANULARITIES,
             f"recompute_granularity {self.recompute_granularity!r} not in "
             f"{RECOMPUTE_GRANULARITIES}.")
        if self.recompute_granularity == "full":
            need(self.recompute_method in ("uniform", "block"),
                 "full recomputation needs recompute_method 'uniform' or 'block'.")
            need(self.recompute_num_layers is not None and self.recompute_num_layers >= 1,
                 "full recomputation needs recompute_num_layers >= 1.")
        else:
            need(self.recompute_method is None,
                 f"recompute_method {self.recompute_method!r} is only used with "
                 f"recompute_granularity 'full'.")
        need(not self.distribute_saved_activations or self.recompute_granularity == "full",
             "distribute_saved_activations needs recompute_granularity 'full'.")
        need(not (self.distribute_saved_activations and self.sequence_parallel),
             "distribute_saved_activations is redundant with sequence_parallel; use one.")
        if self.moe is not None:
            self._check_moe(need)
        if self.qk_clip:
            self._check_qk_clip(need)

    def _check_qk_clip(self, need):
        need(self.qk_clip_threshold > 0,
             f"qk_clip_threshold must be > 0, got {self.qk_clip_threshold}.")
        need(0.0 <= self.qk_clip_alpha <= 1.0,
             f"qk_clip_alpha must be in [0, 1], got {self.qk_clip_alpha}.")
        # A per-head norm after W_q / W_k divides out any scale of their rows (MLA's norms are
        # the latents', before the rows QK-clip scales: no conflict there).
        need(not self.qk_layernorm or self.multi_latent_attention,
             "--qk-clip rescales rows of W_q and W_k, which --qk-layernorm's norms of every "
             "query and key head undo: drop one of them.")

    def _check_latent_attention(self, need):
        """Multi-latent attention's sizes, and what its attention path does not run. Sets
        kv_channels to its query/key head dim, the one the attention kernels see (values are
        zero-padded to it where a kernel needs one head dim)."""
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}.")
        need(self.q_lora_rank is None or self.q_lora_rank >= 1,
             f"q_lora_rank must be >= 1 (or None: no query latent), got {self.q_lora_rank}.")
        need(self.qk_pos_emb_head_dim % 2 == 0,
             f"qk_pos_emb_head_dim must be even (RoPE turns channel pairs), got "
             f"{self.qk_pos_emb_head_dim}.")
        qk = self.qk_head_dim + self.qk_pos_emb_head_dim
        # Where a kernel needs one head dim, values are padded to the query/key one.
        need(self.v_head_dim <= qk,
             f"v_head_dim {self.v_head_dim} is larger than the query/key head dim "
             f"qk_head_dim + qk_pos_emb_head_dim = {qk}: not supported.")
        need(self.kv_channels in (None, qk),
             f"kv_channels {self.kv_channels} does not apply to multi-latent attention, whose "
             f"query/key head dim is qk_head_dim + qk_pos_emb_head_dim = {qk}: drop "
             f"--kv-channels.")
        self.kv_channels = qk
        need(self.position_embedding_type == "rope",
             f"multi-latent attention rotates qk_pos_emb_head_dim channels of each query and "
             f"key: it needs --position-embedding-type rope, got "
             f"{self.position_embedding_type!r}.")
        need(self.rotary_percent == 1.0,
             f"multi-latent attention rotates exactly its qk_pos_emb_head_dim channels: drop "
             f"--rotary-percent {self.rotary_percent}.")
        need(self.num_query_groups in (None, self.num_attention_heads),
             f"multi-latent attention has a key and a value per head, not "
             f"{self.num_query_groups} groups: drop --group-query-attention / "
             f"--num-query-groups.")
        need(self.window_size is None,
             "multi-latent attention does not run sliding windows: drop --window-size.")
        need(self.softmax_type == "vanilla",
             f"multi-latent attention does not run attention sinks (--softmax-type "
             f"{self.softmax_type}): drop --softmax-type.")
        need(self.fp8 is None,
             "multi-latent attention does not run FP8 GEMMs yet: drop --fp8-format.")

    def _check_yarn(self, need):
        need(self.position_embedding_type == "rope",
             f"rope_type 'yarn' scales rotary embeddings, but position_embedding_type is "
             f"{self.position_embedding_type!r}; use --position-embedding-type rope.")
        need(self.rope_scaling_factor is None,
             "YaRN (--rope-type yarn) and LLaMA-3 rope scaling (--use-rope-scaling) both "
             "rescale the rotary frequencies; use one of them.")
        need(self.rotary_scaling_factor >= 1.0,
             f"rotary_scaling_factor must be >= 1 (the context extension), got "
             f"{self.rotary_scaling_factor}.")
        need(self.original_max_position_embeddings >= 1,
             f"original_max_position_embeddings must be >= 1, got "
             f"{self.original_max_position_embeddings}.")
        need(self.beta_fast > 0 and self.beta_slow > 0,
             f"beta_fast and beta_slow must be > 0, got {self.beta_fast} and {self.beta_slow}.")
        need(self.mscale >= 0 and self.mscale_all_dim >= 0,
             f"mscale and mscale_all_dim must be >= 0, got {self.mscale} and "
             f"{self.mscale_all_dim}.")
        need(self.yarn_attention_factor is None or self.yarn_attention_factor > 0,
             f"yarn_attention_factor must be > 0 (or None), got {self.yarn_attention_factor}.")

    def _check_glu(self, need):
        clamp = self.activation_func_clamp_value
        if self.activation not in GATED_ACTIVATIONS:
            need(clamp is None and self.glu_linear_offset == 0.0,
                 f"activation_func_clamp_value and glu_linear_offset change a gated "
                 f"activation's halves; activation {self.activation!r} has none: use "
                 f"--swiglu or --quick-geglu, or drop them.")
        need(clamp is None or 0 < clamp < float("inf"),
             f"activation_func_clamp_value must be a finite value > 0 (or None), got {clamp}.")
        need(abs(self.glu_linear_offset) < float("inf"),
             f"glu_linear_offset must be finite, got {self.glu_linear_offset}.")

    def _check_moe(self, need):
        moe, tp, ep = self.moe, self.tensor_model_parallel_size, self.expert_model_parallel_size
        need(self.activation in GATED_ACTIVATIONS,
             f"the MoE experts are gated FFNs ([gate; up] fc1 rows); activation "
             f"{self.activation!r} is not: use --swiglu or --quick-geglu.")
        # With biases, each expert-TP rank would add fc2's bias to its partial output, and
        # the ETP sum would count it ETP times.
        need(not self.add_bias_linear or self.expert_tensor_parallel_size == 1,
             f"MoE experts with biases (no --disable-bias-linear) need "
             f"expert_tensor_parallel_size 1, got {self.expert_tensor_parallel_size}: add "
             f"--expert-tensor-parallel-size 1 or --disable-bias-linear.")
        need(moe.num_moe_experts % ep == 0,
             f"num_moe_experts {moe.num_moe_experts} is not divisible by "
             f"expert_model_parallel_size {ep}; every EP rank holds the same number of experts.")
        need(tp == 1 or self.sequence_parallel,
             f"MoE with tensor_model_parallel_size {tp} needs sequence_parallel (Megatron's "
             f"rule: each TP rank routes its own part of the sequence); add "
             f"--sequence-parallel.")
        etp = self.expert_tensor_parallel_size
        need(moe.moe_ffn_hidden_size % etp == 0,
             f"moe_ffn_hidden_size {moe.moe_ffn_hidden_size} is not divisible by "
             f"expert_tensor_parallel_size {etp}.")
        if not isinstance(moe.moe_layer_freq, int):
            need(len(moe.moe_layer_freq) == self.num_layers,
                 f"moe_layer_freq lists {len(moe.moe_layer_freq)} layers, the model has "
                 f"{self.num_layers}.")
