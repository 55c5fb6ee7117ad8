"""GPT and LLaMA models built from the transformer and tensor-parallel layers."""
from megatron.core.models.gpt import GPTModel
from megatron.core.models.llama import LlamaModel, llama_config
