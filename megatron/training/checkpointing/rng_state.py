"""Every random generator a training step draws from, as tensors and plain data (so the
checkpoint loads with weights_only=True): python, numpy, torch CPU, the device, and the
tensor-parallel tracker's streams.

Device generator states only fit a device of the type that saved them (a CUDA state is not a
CPU state, not even in size). A checkpoint resumed on another device type (a GPU run resumed
on CPU, or the reverse) gets its device streams reseeded instead, with Megatron's seeds
derived from the run's seed and the iteration, so the resumed run is still reproducible."""
import random
import sys
from typing import Dict

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.tensor_parallel.random import get_rng_tracker, model_parallel_manual_seed

_warned = False


def capture_rng_state() -> Dict:
    version, python_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"random_rng_state": (version, list(python_state), gauss),
             "np_rng_state": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                              "pos": int(pos), "has_gauss": int(has_gauss),
                              "cached_gaussian": float(cached)},
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {k: v.cpu() for k, v in
                                    get_rng_tracker().get_states().items()},
             "device_type": device.device_type()}
    if device.device_type() == "cuda":
        state["cuda_rng_state"] = device.get_rng_state().cpu()
    return state


def saved_device_type(state: Dict) -> str:
    """The device type whose generators ``state`` holds (older checkpoints did not record
    it: only CUDA runs saved a cuda_rng_state)."""
    return state.get("device_type") or ("cuda" if "cuda_rng_state" in state else "cpu")


def _device_states_fit(state: Dict) -> bool:
    here = device.device_type()
    if saved_device_type(state) != here:
        return False
    states = list(state["rng_tracker_states"].values())
    if here == "cuda":
        if "cuda_rng_state" not in state:
            return False
        states.append(state["cuda_rng_state"])
    size = device.get_rng_state().numel()
    return all(s.numel() == size for s in states)


def restore_rng_state(state: Dict, seed: int, iteration: int) -> None:
    """Restore ``state``; where its device streams do not fit this device, reseed them from
    ``seed`` (the run's --seed) and ``iteration`` (the checkpoint's)."""
    version, python_state, gauss = state["random_rng_state"]
    random.setstate((version, tuple(python_state), gauss))
    np_state = state["np_rng_state"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32),
                         np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch_rng_state"])  # the CPU generator is the same everywhere
    if _device_states_fit(state):
        if device.device_type() == "cuda":
            device.set_rng_state(state["cuda_rng_state"])
        get_rng_tracker().set_states(state["rng_tracker_states"])
        return
    _warn_once(f"warning: the checkpoint's random-generator state was saved on "
               f"{saved_device_type(state)} and does not fit {device.device_type()}: the "
               f"dropout streams are reseeded from --seed {seed} and iteration {iteration} "
               f"(python, numpy and CPU states are restored).")
    reseed_device_streams(seed, iteration)


def reseed_device_streams(seed: int, iteration: int) -> None:
    """Megatron's seeds for the device generator (seed + 100 * pp_rank) and the tracker
    (that + 2718 + tp_rank), from ``seed + iteration``; the CPU generator is left as it is."""
    cpu_state = torch.get_rng_state()
    model_parallel_manual_seed(
        seed + iteration + 100 * parallel_state.get_pipeline_model_parallel_rank())
    # On CPU the device generator is the CPU one, already restored from the checkpoint.
    torch.set_rng_state(cpu_state)


def _warn_once(message: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)
