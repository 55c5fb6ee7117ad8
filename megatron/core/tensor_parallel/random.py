"""RNG streams for dropout under tensor parallelism, and activation recomputation.

Two streams exist on the device:
  * the default generator, seeded identically on every TP rank of a model replica: dropout on
    replicated activations (the "data-parallel region") draws the same mask on every TP rank;
  * the tracker's 'model-parallel-rng' stream, seeded per TP rank: dropout on sharded
    activations (inside attention, after a column-parallel layer) draws different masks per
    TP rank, as an unsharded model would over the whole tensor.
DP replicas share seeds, so their masks agree rank for rank.
"""
import contextlib
from typing import Dict

import torch

from megatron.core import device, parallel_state

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
# Megatron's offset between the data-parallel seed and the tensor-parallel seeds.
_TENSOR_PARALLEL_SEED_OFFSET = 2718


class RNGStatesTracker:
    """Named device-RNG states; ``fork(name)`` runs a block on that state and keeps its advance."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states: Dict[str, torch.Tensor] = {}
        self.seeds = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"RNG seed {seed} is already tracked; each stream needs its own seed.")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists.")
        self.seeds.add(seed)
        saved = device.get_rng_state()
        device.manual_seed(seed)
        self.states[name] = device.get_rng_state()
        device.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not tracked; call "
                           f"model_parallel_manual_seed(seed) before using dropout under TP.")
        saved = device.get_rng_state()
        device.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = device.get_rng_state()
            device.set_rng_state(saved)


_RNG_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _RNG_TRACKER


# Megatron's name, kept so its users find it; it works on CPU too.
get_cuda_rng_tracker = get_rng_tracker


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default device generator with ``seed`` (same on all TP ranks) and the tracked
    model-parallel stream with ``seed + 2718 + tp_rank`` (different per TP rank)."""
    tensor_parallel_seed = seed + _TENSOR_PARALLEL_SEED_OFFSET + \
        parallel_state.get_tensor_model_parallel_rank()
    device.manual_seed(seed)
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_parallel_seed)


model_parallel_cuda_manual_seed = model_parallel_manual_seed


def _rng_snapshot():
    return torch.get_rng_state(), device.get_rng_state(), _RNG_TRACKER.get_states()


def _restore_rng(snapshot) -> None:
    cpu_state, device_state, tracker_states = snapshot
    torch.set_rng_state(cpu_state)
    device.set_rng_state(device_state)
    _RNG_TRACKER.set_states(tracker_states)


class CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without keeping its activations; rerun it in backward with the RNG
    states it saw in forward, so recomputed dropout masks are identical.

    With ``distribute_saved_activations`` the saved first input is kept as this rank's 1/TP
    slice and all-gathered before recomputation (Megatron's --distribute-saved-activations).
    """

    @staticmethod
    def forward(ctx, function, distribute_saved_activations, *args):
        ctx.function = function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.rng_snapshot = _rng_snapshot()
        ctx.input_requires_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        with torch.no_grad():
            outputs = function(*args)
        if distribute_saved_activations:
            first = args[0]
            ctx.first_shape = first.shape
            flat = first.detach().reshape(-1)
            size = parallel_state.get_tensor_model_parallel_world_size()
            if flat.numel() % size != 0:
                raise ValueError(f"cannot distribute a saved activation of {flat.numel()} "
                                 f"elements over {size} TP ranks.")
            rank = parallel_state.get_tensor_model_parallel_rank()
            args = (flat.chunk(size)[rank].clone(),) + args[1:]
        ctx.tensor_indices = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_indices])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        from megatron.core.tensor_parallel.mappings import gather_along_first_dim

        args = list(ctx.non_tensor_args)
        for i, saved in zip(ctx.tensor_indices, ctx.saved_tensors):
            args[i] = saved
        if ctx.distribute_saved_activations:
            args[0] = gather_along_first_dim(args[0]).view(ctx.first_shape)
        inputs = [a.detach().requires_grad_(needs_grad) if torch.is_tensor(a) else a
                  for a, needs_grad in zip(args, ctx.input_requires_grad)]

        backward_rng = _rng_snapshot()
        _restore_rng(ctx.rng_snapshot)
        with torch.enable_grad():
            outputs = ctx.function(*inputs)
        _restore_rng(backward_rng)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in inputs)
        return (None, None) + input_grads


def checkpoint(function, distribute_saved_activations: bool, *args):
    """Activation recomputation for ``function(*args)`` (Megatron's tensor_parallel.checkpoint)."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
