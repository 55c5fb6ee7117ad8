"""Small helpers shared across megatron.core."""
import os
import tempfile
import weakref
from typing import Callable


def ensure_divisibility(numerator: int, denominator: int, what: str = "") -> None:
    if denominator <= 0 or numerator % denominator != 0:
        detail = f" ({what})" if what else ""
        raise ValueError(f"{numerator} is not divisible by {denominator}{detail}.")


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """Exact integer division, with a clear error when it is not exact."""
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator


def init_method_normal(std: float):
    """Weight init N(0, std^2)."""
    import torch

    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def scaled_init_std(std: float, num_layers: int) -> float:
    """std / sqrt(2 * num_layers): the init std of the output projections of residual
    branches (GPT-2 / Megatron)."""
    return std / (2.0 * num_layers) ** 0.5


def scaled_init_method_normal(std: float, num_layers: int):
    """N(0, scaled_init_std(std, num_layers)^2) for the output projections of residual
    branches."""
    return init_method_normal(scaled_init_std(std, num_layers))


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Pad the vocabulary to a multiple of ``make_vocab_size_divisible_by * TP`` so every TP
    rank holds an equal slice (and GEMMs get friendly shapes)."""
    if orig_vocab_size < 1 or make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"vocab size ({orig_vocab_size}), make-vocab-size-divisible-by "
            f"({make_vocab_size_divisible_by}) and TP size ({tensor_model_parallel_size}) "
            f"must all be positive.")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def write_atomically(path: str, write: Callable, binary: bool = False) -> None:
    """``write(file)`` to a temporary file next to ``path``, then rename it over ``path``: a
    reader sees the old file or the whole new one, never half. The file gets the permissions a
    plain ``open()`` would give (``mkstemp``'s are owner-only)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + "-")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def weak_hook(method):
    """``method`` (a bound method) as a hook that does not keep its object alive. Autograd holds
    a tensor's hooks in C++, where the garbage collector cannot follow them: a parameter whose
    hook is its owner's bound method forms a cycle (parameter -> hook -> owner -> parameter)
    that is never freed, so a dropped model would keep its memory for the life of the process."""
    ref = weakref.WeakMethod(method)

    def hook(*args, **kwargs):
        bound = ref()
        if bound is not None:
            return bound(*args, **kwargs)
        return None

    return hook

