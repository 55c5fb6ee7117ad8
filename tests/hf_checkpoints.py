"""Random tiny Hugging Face models saved as a user downloads them (config.json, weights in
any of the formats the converter reads, a tokenizer), for the checkpoint conversion tests."""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools", "checkpoint")
VOCAB = 100

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
MODELS = {
    # 8 heads in 4 query groups: TP 4 divides both.
    "llama_gqa": dict(num_attention_heads=8, num_key_value_heads=4, rope_theta=10000.0,
                      tie_word_embeddings=False),
    "llama3_rope_tied": dict(num_attention_heads=4, num_key_value_heads=2,
                             rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                             tie_word_embeddings=True),
    "gpt2": {},
}


def converter():
    """tools/checkpoint/convert.py and its helpers, importable (a folder of scripts)."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import convert

    return convert


def build_model(name: str, num_layers: int = 4, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=num_layers,
                                         n_head=4, n_positions=64, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                         eos_token_id=2)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64,
                                          intermediate_size=96, num_hidden_layers=num_layers,
                                          max_position_embeddings=64, rms_norm_eps=1e-6,
                                          **MODELS[name])
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norms and biases, so their mapping is checked too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save_tokenizer(path: str, tokens: int = VOCAB) -> None:
    """A word-level tokenizer of exactly ``tokens`` tokens (by default the model's
    vocabulary)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, tokens)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                         eos_token="</s>", unk_token="<unk>").save_pretrained(path)


def save_model(model, path: str, fmt: str = "safetensors", tokenizer: bool = True) -> str:
    """``fmt``: safetensors | safetensors_sharded | bin | bin_sharded | bin_base_names (a
    .bin saved from the base model, without the ``transformer.`` prefix, with buffers)."""
    os.makedirs(path, exist_ok=True)
    if fmt.startswith("safetensors"):
        model.save_pretrained(path, max_shard_size="20KB" if fmt.endswith("sharded")
                              else "5GB")
    else:
        model.config.save_pretrained(path)
        model.generation_config.save_pretrained(path)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        if fmt == "bin":
            torch.save(state, os.path.join(path, "pytorch_model.bin"))
        elif fmt == "bin_base_names":
            base = {k.split(".", 1)[1]: v for k, v in state.items() if k != "lm_head.weight"}
            base["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))  # old GPT-2 buffer
            torch.save(base, os.path.join(path, "pytorch_model.bin"))
        else:
            names = sorted(state)
            halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
                      "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
            for file, keys in halves.items():
                torch.save({k: state[k] for k in keys}, os.path.join(path, file))
            with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
                json.dump({"weight_map": {k: file for file, keys in halves.items()
                                          for k in keys}}, f)
    if tokenizer:
        save_tokenizer(path)
    return path


def megatron_flags(checkpoint_dir) -> list:
    """The flags a converted checkpoint's megatron_flags.txt gives (comments left out)."""
    import shlex

    with open(os.path.join(str(checkpoint_dir), "megatron_flags.txt")) as f:
        return shlex.split(" ".join(ln for ln in f.read().splitlines() if not ln.startswith("#")))


def assert_generate_continues_as(hf_dir, original, capsys) -> None:
    """tools/checkpoint/generate.py on ``hf_dir`` prints the greedy continuation of "w3 w4 w5"
    (tokens 3, 4, 5 of save_tokenizer's vocabulary) that the HF model ``original`` gives."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location(
        "generate", os.path.join(ROOT, "tools", "checkpoint", "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    capsys.readouterr()
    assert generate.main(["--hf-dir", str(hf_dir), "--prompt", "w3 w4 w5",
                          "--max-new-tokens", "4"]) == 0
    with torch.no_grad():
        ids = original.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False,
                                pad_token_id=2)[0, 3:].tolist()
    ids = ids[:ids.index(2)] if 2 in ids else ids  # generation stops at </s> (id 2)
    assert f"-> {' '.join(f'w{i}' for i in ids)!r}" in capsys.readouterr().out


def read_safetensors_dir(path: str):
    """Every tensor of a saved HF directory (single file or sharded with an index)."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for file in files:
        out.update(load_file(os.path.join(path, file)))
    return out
