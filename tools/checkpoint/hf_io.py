"""Reading and writing Hugging Face model directories without a running model: config.json,
weights (safetensors, single or sharded with an index; ``pytorch_model*.bin`` loaded with
``weights_only=True``), and the tokenizer files that travel with a checkpoint."""
import json
import os
import pickle
import re
import shutil
from typing import Dict, List, Optional

import torch

import hf_moe_io
from conversion_utils import ConversionError, Progress, say

# architectures entry -> model_type
SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
             "GPT2LMHeadModel": "gpt2", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral",
             "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
             "GptOssForCausalLM": "gpt_oss", "DeepseekV3ForCausalLM": "deepseek_v3"}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "gpt2": "GPT2Config",
                   "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                   "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig",
                   "qwen3_moe": "Qwen3MoeConfig", "gpt_oss": "GptOssConfig",
                   "deepseek_v3": "DeepseekV3Config"}
SUPPORTED_TEXT = ", ".join(f"{a} (model_type {t})" for a, t in SUPPORTED.items())

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "chat_template.jinja", "generation_config.json")

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
# Buffers some checkpoints carry next to the parameters: recomputed by the model, not mapped.
_BUFFERS = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# Block-quantized FP8 weights (DeepSeek-V3's release) carry a ``weight_scale_inv`` each.
_FP8_SCALE = "_scale_inv"

# The config.json fields that size each family's tensors or route its experts. transformers
# fills a missing one with its own default (hidden_size 4096, ...), a model other than the
# weights; a missing field that has a derived meaning (head_dim: hidden / heads,
# num_key_value_heads: the heads) is not listed.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads")
_ROUTING = ("num_experts_per_tok",)
REQUIRED_FIELDS = {
    "llama": _SIZES, "mistral": _SIZES, "qwen2": _SIZES,
    "qwen3": _SIZES + ("head_dim",),  # Qwen3Config's default is 128, not hidden / heads
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"),
    "mixtral": _SIZES + _ROUTING + ("num_local_experts",),
    "qwen2_moe": _SIZES + _ROUTING + ("num_experts", "moe_intermediate_size",
                                      "shared_expert_intermediate_size"),
    "qwen3_moe": _SIZES + _ROUTING + ("num_experts", "moe_intermediate_size"),
    "gpt_oss": _SIZES + _ROUTING + ("num_local_experts", "head_dim"),
    "deepseek_v3": _SIZES + _ROUTING + (
        "n_routed_experts", "moe_intermediate_size", "n_shared_experts",
        "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
}
_NULLABLE_FIELDS = {"q_lora_rank"}  # DeepSeek-V3 without the query latent: null


def read_config(hf_dir: str):
    """The transformers config of ``hf_dir``, after checking it is a supported architecture."""
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"Hugging Face model directory {hf_dir} does not exist.")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{hf_dir} has no config.json; give the directory written by "
                              f"save_pretrained() (or downloaded from the hub).")
    return read_config_file(path)


def read_config_file(path: str):
    """The transformers config in the file ``path`` (a config.json), checked as above."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{path} is not valid JSON ({exc}).") from None
    if not isinstance(raw, dict):
        raise ConversionError(f"{path} holds no JSON object; a config.json is one.")
    model_type, archs = raw.get("model_type"), raw.get("architectures") or []
    unknown = [a for a in archs if a not in SUPPORTED]
    if model_type not in SUPPORTED.values() or unknown:
        raise ConversionError(
            f"unsupported architecture: model_type {model_type!r}, architectures {archs} "
            f"in {path}; supported: {SUPPORTED_TEXT}.")
    quantized = (raw.get("quantization_config") or {}).get("quant_method")
    if quantized == "fp8":  # refused before reading the weights (DeepSeek-V3's: 700 GB)
        raise ConversionError(_fp8_message(os.path.dirname(path) or ".",
                                           "quantization_config fp8 in config.json"))
    import transformers  # deferred: seconds to import

    config_class = getattr(transformers, _CONFIG_CLASSES[model_type])
    _check_required_fields(raw, model_type, config_class.attribute_map, path)
    config = config_class.from_dict(raw)
    # gpt-oss's hidden_act is unused (its experts' clamped quick-GeGLU is fixed)
    if model_type not in ("gpt2", "gpt_oss") and getattr(config, "hidden_act", "silu") != "silu":
        raise ConversionError(f"{path}: hidden_act {config.hidden_act!r} is not supported "
                              f"(LLaMA's MLP is SwiGLU: 'silu').")
    return config


def _check_required_fields(raw: Dict, model_type: str, aliases: Dict[str, str],
                           path: str) -> None:
    """ConversionError naming the fields of REQUIRED_FIELDS that ``raw`` (config.json's own
    keys, before transformers fills in defaults) lacks; ``aliases`` (the config class's
    attribute_map: other name -> field) count as the field."""
    given = {aliases.get(k, k) for k, v in raw.items() if v is not None or k in _NULLABLE_FIELDS}
    missing = [f for f in REQUIRED_FIELDS[model_type] if aliases.get(f, f) not in given]
    if missing:
        raise ConversionError(
            f"{path} lacks {', '.join(missing)}, which a {model_type} model needs: add "
            f"{'it' if len(missing) == 1 else 'them'} with the value(s) of the model's weights; "
            f"no default is assumed (transformers' own, e.g. hidden_size 4096, would describe "
            f"another model).")


def _fp8_message(where: str, evidence: str) -> str:
    return (f"the weights in {where} are FP8-quantized ({evidence}), which this converter "
            f"does not read; dequantize the checkpoint to bf16 first (each weight times its "
            f"weight_scale_inv per block, e.g. DeepSeek-V3's inference/fp8_cast_bf16.py) and "
            f"convert that.")


def check_sliding_window(config, allowed: bool) -> Optional[str]:
    """Qwen2's sliding window (on the layers from max_window_layers on) is not implemented:
    its attention is LLaMA's only while sequences fit in the window. Returns a warning when
    ``allowed``, raises otherwise. (Mistral's, on every layer, converts: --window-size.)"""
    window = getattr(config, "sliding_window", None)
    if config.model_type != "qwen2" or not getattr(config, "use_sliding_window", False) or \
            window is None or window >= config.max_position_embeddings:
        return None
    message = (f"this Qwen2 model uses sliding-window attention on its layers from "
               f"max_window_layers on (window {window} < max_position_embeddings "
               f"{config.max_position_embeddings}), which this framework does not map: "
               f"attention is identical for sequences up to {window} tokens only")
    if not allowed:
        raise ConversionError(message + "; pass --ignore-sliding-window to convert anyway.")
    return message + "."


def _load_bin(path: str) -> Dict[str, torch.Tensor]:
    """A ``pytorch_model*.bin``; only tensors and plain data are unpickled, so a file made to
    run code when loaded is refused instead."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy format
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConversionError(
            f"refusing to load {path}: it holds objects other than tensors and plain data, "
            f"which could run code when unpickled ({first[:120]}). Get the safetensors "
            f"version of this model, or a .bin from a source you trust.") from None
    except Exception as exc:
        raise ConversionError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict):
        raise ConversionError(f"{path} does not hold a state dict.")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _load_safetensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except SafetensorError:  # its header or data do not add up: the bytes are incomplete
        raise ConversionError(f"{path} is damaged or truncated (not a complete safetensors "
                              f"file, as an interrupted download or copy leaves it); "
                              f"re-download it, or re-save the model with "
                              f"save_pretrained.") from None
    except Exception as exc:
        raise ConversionError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


def weight_files(hf_dir: str) -> List[str]:
    """The weight files of ``hf_dir`` (safetensors preferred), all checked to exist."""
    for name in _WEIGHT_FILES:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".index.json"):
            return [path]
        try:
            with open(path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ConversionError(f"{path} is not a valid weight index ({exc}).") from None
        missing = [s for s in shards if not os.path.isfile(os.path.join(hf_dir, s))]
        if missing:
            raise ConversionError(f"{path} lists {len(missing)} weight file(s) missing from "
                                  f"{hf_dir}, e.g. {missing[0]}; the download is incomplete.")
        return [os.path.join(hf_dir, s) for s in shards]
    raise ConversionError(f"{hf_dir} holds no weights: expected one of {', '.join(_WEIGHT_FILES)}.")


def read_weights(hf_dir: str, progress: bool = True) -> Dict[str, torch.Tensor]:
    files = weight_files(hf_dir)
    bar = Progress("reading Hugging Face weights", len(files)) if progress else None
    state = {}
    for i, path in enumerate(files):
        state.update(_load_safetensors(path) if path.endswith(".safetensors")
                     else _load_bin(path))
        if bar:
            bar(i + 1, note=os.path.basename(path))
    return state


def expected_tensors(config, source: str) -> Dict[str, torch.Tensor]:
    """Shape-only (meta device) tensors of every weight of ``config``'s model, as
    transformers builds it, under the names checkpoints on disk use (experts per expert);
    ``source`` names where ``config`` came from, for the error."""
    import transformers

    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # sizes transformers cannot build (e.g. negative)
        raise ConversionError(f"transformers cannot build the model {source} describes "
                              f"({type(exc).__name__}: {exc}); correct it.") from None
    state = dict(model.state_dict())
    if hf_moe_io.is_moe(config.model_type):  # transformers >= 5 holds them stacked
        state = hf_moe_io.per_expert_weights(state, config)
    return state


def embedding_name(model_type: str) -> str:
    return "transformer.wte.weight" if model_type == "gpt2" else "model.embed_tokens.weight"


def expected_names(model_type: str, num_layers: int, tied: bool, config=None) -> List[str]:
    """The HF parameter names this converter maps (``lm_head.weight`` only when untied); the
    MoE models' need their ``config`` (experts per expert, as on disk)."""
    if hf_moe_io.is_moe(model_type):
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        names += [f"model.layers.{i}.{n}" for i in range(num_layers)
                  for n in hf_moe_io.expected_layer_names(config, i)]
        return names + ([] if tied else ["lm_head.weight"])
    if model_type == "gpt2":
        names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
                 "transformer.ln_f.bias"]
        per_layer = [f"{m}.{k}" for m in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj",
                                          "mlp.c_fc", "mlp.c_proj") for k in ("weight", "bias")]
        prefix = "transformer.h.{}."
    else:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"] + \
            [f"self_attn.{x}_proj.weight" for x in "qkvo"] + \
            [f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")] + \
            ([f"self_attn.{x}_proj.bias" for x in "qkv"] if model_type == "qwen2" else []) + \
            ([f"self_attn.{x}_norm.weight" for x in "qk"] if model_type == "qwen3" else [])
        prefix = "model.layers.{}."
    names += [prefix.format(i) + n for i in range(num_layers) for n in per_layer]
    return names + ([] if tied else ["lm_head.weight"])


def normalized_weights(state: Dict[str, torch.Tensor], config, num_layers: int, tied: bool,
                       where: str) -> Dict[str, torch.Tensor]:
    """HF weights under the names of ``*ForCausalLM`` (a base model's checkpoint lacks the
    ``transformer.``/``model.`` prefix; stacked MoE experts become per-expert ones), buffers
    dropped, checked complete and with nothing this converter would silently ignore."""
    top = "transformer." if config.model_type == "gpt2" else "model."
    out = {}
    for name, tensor in state.items():
        if _BUFFERS.search(name):
            continue
        if not name.startswith((top, "lm_head.")):
            name = top + name
        out[name] = tensor
    fp8 = next((n for n in out if n.endswith(_FP8_SCALE)), None)
    if fp8 is not None:
        raise ConversionError(_fp8_message(where, fp8))
    if config.model_type == "deepseek_v3":
        out = _without_mtp_layers(out, num_layers, where)
    if hf_moe_io.is_moe(config.model_type):
        out = hf_moe_io.per_expert_weights(out, config)
    wanted = expected_names(config.model_type, num_layers, tied, config)
    missing = [n for n in wanted if n not in out]
    if missing:
        raise ConversionError(f"the weights in {where} lack {len(missing)} tensor(s) of a "
                              f"{config.model_type} model with {num_layers} layers, e.g. "
                              f"{missing[0]}; the checkpoint is incomplete or does not match "
                              f"its config.json.")
    extra = sorted(set(out) - set(wanted) - {"lm_head.weight"})
    if extra:
        raise ConversionError(f"the weights in {where} hold {len(extra)} tensor(s) this "
                              f"converter does not map, e.g. {extra[0]}; this is not a plain "
                              f"{config.model_type} model (or config.json does not match it).")
    return out


def _without_mtp_layers(state: Dict[str, torch.Tensor], num_layers: int,
                        where: str) -> Dict[str, torch.Tensor]:
    """DeepSeek-V3's checkpoints hold its multi-token prediction modules as layers past
    num_hidden_layers (model.layers.61.* for 61 layers); HF's model drops them, and so do we
    (with a note: they are not converted)."""
    def past_the_model(name: str) -> bool:
        match = _LAYER_INDEX.match(name)
        return match is not None and int(match.group(1)) >= num_layers

    kept = {n: t for n, t in state.items() if not past_the_model(n)}
    if len(kept) == len(state):
        return state
    layers = ", ".join(f"model.layers.{i}" for i in sorted(
        {int(_LAYER_INDEX.match(n).group(1)) for n in state if n not in kept}))
    say(f"note: dropped the {len(state) - len(kept)} tensor(s) of {layers} in {where}: "
        f"multi-token prediction layer(s) past the model's {num_layers}, which "
        f"DeepseekV3ForCausalLM does not use; the MTP weights are not converted.")
    return kept


def parse_size(text: str) -> int:
    """'5GB' (10^9), '500MiB' (2^20), '100KB', or a number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a size like 5GB, 500MB or 1000000")
    number, unit = float(match.group(1)), match.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12,
             "KI": 2 ** 10, "MI": 2 ** 20, "GI": 2 ** 30, "TI": 2 ** 40}[unit]
    size = int(number * scale)
    if size < 1:
        raise ValueError(f"{text!r} is not a positive size")
    return size


def _model_order(name: str):
    """Embeddings first, then layer by layer, then the rest (final norm, head)."""
    match = re.search(r"\.(?:layers|h)\.(\d+)\.", name)
    if match:
        return (1, int(match.group(1)), name)
    return (0 if "emb" in name or ".wte." in name or ".wpe." in name else 2, 0, name)


def write_weights(out_dir: str, state: Dict[str, torch.Tensor], max_shard_bytes: int,
                  progress: bool = True) -> List[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` (a larger tensor gets a shard of its own) with
    ``model.safetensors.index.json``, as ``save_pretrained`` writes them."""
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name in sorted(state, key=_model_order):
        nbytes = state[name].numel() * state[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = state[name]
        size += nbytes
    shards.append(current)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    bar = Progress("writing safetensors", len(shards)) if progress else None
    for i, (name, shard) in enumerate(zip(names, shards)):
        save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(out_dir, name),
                  metadata={"format": "pt"})
        if bar:
            bar(i + 1, note=name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in state.values())},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
    return names


def copy_tokenizer_files(src: Optional[str], dst: str) -> List[str]:
    """Copy the tokenizer (and generation config) files found in ``src`` into ``dst``;
    returns their names (none: ``dst`` is not created)."""
    if not src or not os.path.isdir(src):
        return []
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    if names:
        os.makedirs(dst, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return names


def tokenizer_size(tokenizer_dir: str) -> Optional[int]:
    """Tokens of a ``tokenizer.json`` (added tokens included), or None without one."""
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    except Exception:  # an unreadable tokenizer is the training run's problem, not ours
        return None


def special_token_ids(tokenizer_dir: Optional[str]) -> Dict[str, int]:
    """bos/eos/pad ids for the HF config: from generation_config.json, else the tokenizer."""
    if not tokenizer_dir or not os.path.isdir(tokenizer_dir):
        return {}
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    path = os.path.join(tokenizer_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            found = json.load(f)
        return {k: found[k] for k in keys if found.get(k) is not None}
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception:
        return {}
    return {k: getattr(tok, k) for k in keys if getattr(tok, k, None) is not None}
