"""Looking through wrappers (DDP, mixed-precision) to the model chunk they hold."""
import torch


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside wrappers that keep it as ``.module``."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def get_model_config(model: torch.nn.Module):
    return unwrap_model(model).config
