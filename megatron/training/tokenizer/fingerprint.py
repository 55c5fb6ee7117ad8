"""A tokenizer's fingerprint: a hash of its vocabulary, recorded in every checkpoint (and in
converted ones) so that loading with another tokenizer of the same padded size is noticed.

The hash is sha256 over the sorted (token, id) pairs: the same vocabulary gives the same hash
whatever the file format or the directory it was loaded from."""
import hashlib
import json
from typing import Dict, Optional

FINGERPRINT_ARG = "tokenizer_fingerprint"  # the key in a checkpoint's saved args
FINGERPRINT_FILE = "megatron_tokenizer_fingerprint.json"  # beside an HF export


def vocabulary_hash(vocab: Dict[str, int]) -> str:
    pairs = sorted((str(token), int(i)) for token, i in vocab.items())
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode("utf-8")).hexdigest()


def fingerprint(tokenizer, source: Optional[str] = None) -> Dict:
    """{"type", "source", "vocab_size", "sha256"} of a built tokenizer (any MegatronTokenizer;
    NullTokenizer's vocabulary is its ids, so its vocab size decides its hash)."""
    return {"type": type(tokenizer).__name__, "source": source,
            "vocab_size": int(tokenizer.vocab_size), "sha256": vocabulary_hash(tokenizer.vocab)}


def fingerprint_from_args(args, tokenizer=None) -> Dict:
    """The fingerprint of the tokenizer the flags name: ``tokenizer`` when the caller has
    built it already, else built here."""
    from megatron.training.tokenizer.build import build_tokenizer_from_args

    source = (getattr(args, "tokenizer_name_or_path", None) or
              getattr(args, "tokenizer_model", None) or getattr(args, "vocab_file", None))
    return fingerprint(tokenizer or build_tokenizer_from_args(args), source)


def fingerprint_of_hf_directory(path: Optional[str]) -> Optional[Dict]:
    """The fingerprint of a Hugging Face tokenizer directory; None when it holds none."""
    if not path:
        return None
    from megatron.training.tokenizer.huggingface import HuggingFaceTokenizer

    try:
        return fingerprint(HuggingFaceTokenizer(path), path)
    except (FileNotFoundError, ValueError):
        return None


def describe(fp: Dict) -> str:
    source = f" {fp['source']}" if fp.get("source") else ""
    return (f"{fp.get('type', 'tokenizer')}{source} ({fp.get('vocab_size')} tokens, "
            f"vocabulary sha256 {str(fp.get('sha256'))[:12]})")


def differ(saved: Optional[Dict], current: Optional[Dict]) -> bool:
    """True only when both are known and their vocabularies differ (old checkpoints record
    none: no warning for them)."""
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return False
    return bool(saved.get("sha256")) and saved.get("sha256") != current.get("sha256")


def mismatch_warning(saved: Dict, current: Dict, checkpoint: str, finetune: bool) -> str:
    """The warning for a checkpoint trained with another tokenizer."""
    text = (f"warning: the checkpoint {checkpoint} was trained with the tokenizer "
            f"{describe(saved)}, but this run uses {describe(current)}: the same token ids "
            f"mean other tokens.")
    if finetune:
        return text + (" With --finetune a new tokenizer is legitimate only if the embedding "
                       "rows were remapped to the new ids; otherwise use the checkpoint's "
                       "tokenizer.")
    return text + " Use the checkpoint's tokenizer to continue its training."
