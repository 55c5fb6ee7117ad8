"""Small helpers shared across megatron.core."""


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


def scaled_init_method_normal(std: float, num_layers: int):
    """N(0, (std / sqrt(2 * num_layers))^2) for the output projections of residual branches."""
    return init_method_normal(std / (2.0 * num_layers) ** 0.5)
