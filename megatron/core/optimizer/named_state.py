"""The optimizer checkpoint format shared by every Megatron optimizer.

Optimizer state is keyed by model-parameter name (``"{chunk}/{name}"``), not by position in a
torch optimizer, so a checkpoint taken with one optimizer (plain or distributed, any DP size)
loads into another, and the checkpoint code can reshard it like the model's own tensors:

    {"params": {"0/decoder.layers.0.mlp.linear_fc1.weight":
                    {"param": fp32 main (only where it is a copy of a bf16/fp16 param),
                     "exp_avg": ..., "exp_avg_sq": ...}, ...},
     "step": float or None, "state_keys": [...], "param_groups": [hyperparameters],
     "num_skipped_steps": int, "grad_scaler": {...} (with loss scaling)}

Every per-parameter tensor has the model parameter's shape. As with torch's optimizers, the
tensors may be the live state (on CPU): copy them to keep a snapshot.
"""
from typing import Callable, Dict, List, Optional

import torch


def param_key(chunk: int, name: str) -> str:
    return f"{chunk}/{name}"


def state_keys(optimizer: torch.optim.Optimizer, elementwise) -> List[str]:
    """Names of the torch optimizer's per-element state tensors (exp_avg, momentum_buffer...);
    ``elementwise(param, value)`` says whether ``value`` is one."""
    keys = set()
    for param, state in optimizer.state.items():
        keys.update(k for k, v in state.items() if torch.is_tensor(v) and elementwise(param, v))
    return sorted(keys)


def wrap_state(optimizer: torch.optim.Optimizer, params: Dict[str, Dict[str, torch.Tensor]],
               step: Optional[float], keys: List[str], num_skipped_steps: int,
               grad_scaler) -> Dict:
    state = {"params": params, "step": step, "state_keys": keys,
             "param_groups": [{k: v for k, v in g.items() if k != "params"}
                              for g in optimizer.param_groups],
             "num_skipped_steps": num_skipped_steps}
    if grad_scaler is not None:
        state["grad_scaler"] = grad_scaler.state_dict()
    return state


class SavedTensor:
    """A saved per-parameter tensor read on demand (the sharded checkpoint format): a rank
    reads only the range it owns, never the whole tensor at once unless it needs it."""

    def __init__(self, numel: int, read: Callable[[int, int], torch.Tensor]):
        self._numel, self._read = numel, read

    def numel(self) -> int:
        return self._numel


def saved_range(saved, begin: int, end: int) -> torch.Tensor:
    """Flat elements ``[begin, end)`` of a saved tensor (a tensor or a SavedTensor)."""
    if isinstance(saved, SavedTensor):
        return saved._read(begin, end)
    return saved.reshape(-1)[begin:end]


def saved_like(saved, like: torch.Tensor) -> torch.Tensor:
    """The whole saved tensor, shaped as ``like``."""
    return saved_range(saved, 0, saved.numel()).view_as(like)


def check_covers(state: Dict, wanted: List[str]) -> None:
    if "params" not in state:
        raise ValueError("the optimizer checkpoint is not in this project's format (no "
                         "'params'); load with --no-load-optim.")
    missing = [key for key in wanted if key not in state["params"]]
    if missing:
        raise ValueError(f"the optimizer checkpoint lacks {len(missing)} parameters (e.g. "
                         f"{missing[0]}); it is for another model or pipeline layout. Load "
                         f"with --no-load-optim.")


def check_numel(key: str, saved: torch.Tensor, param: torch.Tensor) -> None:
    if saved.numel() != param.numel():
        raise ValueError(f"optimizer checkpoint: {key} has {saved.numel()} elements, the "
                         f"model {param.numel()}; load with --no-load-optim.")


def optimizer_kind(param_groups: List[Dict]) -> str:
    """The --optimizer whose param groups these are (saved or live): Muon's carry
    ``use_muon``, Adam's ``betas``, SGD's neither."""
    if any("use_muon" in g for g in param_groups):
        return "muon"
    return "adam" if any("betas" in g for g in param_groups) else "sgd"


def load_torch_state(optimizer: torch.optim.Optimizer,
                     per_param: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]],
                     saved_groups: List[Dict]) -> None:
    """Install per-parameter state and the saved hyperparameters into a torch optimizer."""
    saved, ours = optimizer_kind(saved_groups), optimizer_kind(optimizer.param_groups)
    if saved != ours:  # another optimizer's state would be read as this one's, or crash
        raise ValueError(f"the optimizer checkpoint is of --optimizer {saved}, this run uses "
                         f"--optimizer {ours}; keep --optimizer {saved}, or load the weights "
                         f"alone with --no-load-optim.")
    torch_state = optimizer.state_dict()
    ids = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    torch_state["state"] = {ids[p]: s for p, s in per_param.items()}
    for group, saved_group in zip(torch_state["param_groups"], saved_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    optimizer.load_state_dict(torch_state)


def load_scaler_and_counters(optimizer, state: Dict) -> None:
    """``optimizer`` is a MegatronOptimizer."""
    optimizer.num_skipped_steps = int(state.get("num_skipped_steps", 0))
    if optimizer.grad_scaler is not None:
        if "grad_scaler" not in state:
            raise ValueError("the checkpoint has no loss-scaler state but this run scales "
                             "the loss; load without the optimizer (--no-load-optim).")
        optimizer.grad_scaler.load_state_dict(state["grad_scaler"])
