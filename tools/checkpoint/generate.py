"""Generate a few tokens with Hugging Face ``transformers`` from a converted checkpoint: the
proof that a model trained here is an ordinary HF model.

    python3 tools/checkpoint/generate.py --hf-dir HF_OUT --prompt "three plus four is"
"""
import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True,
                        help="a directory with config.json, weights and tokenizer files")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeat the flag for several)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        print(f"error: --hf-dir {args.hf_dir} has no config.json; convert a checkpoint with "
              f"tools/checkpoint/convert.py megatron-to-hf first.", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    for prompt in args.prompt or ["three plus four is"]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        print(f"{prompt!r} -> {text!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
