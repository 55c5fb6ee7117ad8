"""A checkpoint's vocabulary rows against this run's, said before any tensor is read: the
usual cause is a model padded by its authors (Qwen) trained without --padded-vocab-size."""
from typing import Dict

from megatron.training.checkpointing.paths import CheckpointError


def check_vocabulary(saved_layout: Dict, layout: Dict, tokens: int, iteration_dir: str) -> None:
    """CheckpointError naming the fix when the saved rows differ from this run's. ``tokens``:
    this run's tokenizer vocabulary (the rows it keeps are ``layout['vocab_size']``)."""
    saved, here = saved_layout.get("vocab_size"), layout["vocab_size"]
    if saved is None or saved == here:
        return
    problem = (f"{iteration_dir} has {saved} vocabulary rows and this run {here} (its "
               f"tokenizer has {tokens} tokens)")
    if saved > tokens:
        fix = (f"pass --padded-vocab-size {saved} to keep the checkpoint's rows (those past "
               f"the tokenizer's tokens stay out of the softmax)")
    elif saved == tokens:
        fix = "leave out --padded-vocab-size: the checkpoint holds one row per token"
    else:
        fix = "train with the tokenizer the checkpoint was made with"
    raise CheckpointError(f"{problem}; {fix}.")
