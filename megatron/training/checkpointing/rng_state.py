"""Every random generator a training step draws from, as tensors and plain data (so the
checkpoint loads with weights_only=True): python, numpy, torch CPU, the device, and the
tensor-parallel tracker's streams."""
import random
from typing import Dict

import numpy as np
import torch

from megatron.core import device
from megatron.core.tensor_parallel.random import get_rng_tracker


def capture_rng_state() -> Dict:
    version, python_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"random_rng_state": (version, list(python_state), gauss),
             "np_rng_state": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                              "pos": int(pos), "has_gauss": int(has_gauss),
                              "cached_gaussian": float(cached)},
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {k: v.cpu() for k, v in
                                    get_rng_tracker().get_states().items()}}
    if device.device_type() == "cuda":
        state["cuda_rng_state"] = device.get_rng_state().cpu()
    return state


def restore_rng_state(state: Dict) -> None:
    version, python_state, gauss = state["random_rng_state"]
    random.setstate((version, tuple(python_state), gauss))
    np_state = state["np_rng_state"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32),
                         np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch_rng_state"])
    if device.device_type() == "cuda" and "cuda_rng_state" in state:
        device.set_rng_state(state["cuda_rng_state"])
    get_rng_tracker().set_states(state["rng_tracker_states"])
