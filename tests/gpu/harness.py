"""What the GPU tests share: several ranks on the one GPU, and in-process pretrain() runs.

Several ranks on one GPU: nccl refuses two ranks on one device ("Duplicate GPU detected"), so
multi-rank tests use MEGATRON_DEVICE=cuda with gloo collectives (MEGATRON_DIST_BACKEND=gloo,
MEGATRON_ALLOW_SHARED_GPU=1). ProcessGroupGloo takes CUDA tensors for all_reduce, broadcast,
all_gather and all_gather_into_tensor (it stages them through pinned host memory on side
streams), and for reduce_scatter_tensor (an all_reduce of a copy, then this rank's chunk);
not for send/recv: those hand gloo's TCP transport the tensor's raw pointer, which must be host
memory. ``host_staged_p2p`` therefore copies pipeline messages through the host around
``batch_isend_irecv`` (test-only: nccl sends device memory directly). Single-process runs use
nccl, so the nccl backend itself runs (a world of one); nccl between ranks needs one GPU per
rank and is left to a multi-GPU machine (docs/gpu.md).
"""
import contextlib
import os
from typing import Optional

import torch
import torch.distributed as dist

from tests import distributed

# TF32 off: fp32 tolerances are fp32's. One CUDA queue: Megatron's rule for TP on CUDA.
# cuBLAS's deterministic workspace, for the bitwise resume checks.
GPU_ENV = {"MEGATRON_DEVICE": "cuda", "MEGATRON_ALLOW_SHARED_GPU": "1",
           "MEGATRON_ALLOW_TF32": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def run_on_gpu(fn, world_size: int, backend: str = "gloo", timeout: float = 300, **kwargs):
    """run_distributed on the GPU: ranks spawned with GPU_ENV (set by the ``gpu_env`` fixture)
    and ``backend`` (tests/distributed.py replaces a pool made for another one)."""
    os.environ["MEGATRON_DIST_BACKEND"] = backend
    return distributed.run_distributed(fn, world_size=world_size, timeout=timeout, **kwargs)


class _StagedRequests:
    def __init__(self, requests, copies):
        self.requests, self.copies = requests, copies

    def wait(self):
        for request in self.requests:
            request.wait()
        with torch.no_grad():
            for target, host in self.copies:
                target.copy_(host)
        return True


@contextlib.contextmanager
def host_staged_p2p(stage: Optional[bool] = None):
    """Pipeline and CP-ring sends/receives of CUDA tensors over gloo, through host copies
    (``stage``: None = when the device is cuda and the backend gloo). The ring imported the
    function by name: its reference is replaced too."""
    from megatron.core import device
    from megatron.core.transformer.context_parallel import ring

    if stage is None:
        stage = device.device_type() == "cuda" and device.dist_backend() == "gloo"
    if not stage:
        yield
        return
    original = dist.batch_isend_irecv

    def staged(ops):
        host_ops, copies = [], []
        for op in ops:
            # a send's contents or a receive's buffer
            host = op.tensor.detach().to("cpu", copy=True)
            if op.op in (dist.irecv, dist.recv):
                copies.append((op.tensor, host))
            host_ops.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
        return [_StagedRequests(original(host_ops), copies)]

    dist.batch_isend_irecv = ring.batch_isend_irecv = staged
    try:
        yield
    finally:
        dist.batch_isend_irecv = ring.batch_isend_irecv = original


@contextlib.contextmanager
def deterministic():
    """Run-to-run identical kernels: no atomics-based attention backward, deterministic
    alternatives elsewhere (an op without one raises, which is itself a finding)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(False)


class RepeatedBatch(torch.utils.data.Dataset):
    """The first ``batch`` samples of ``dataset``, over and over, at its length: the samplers
    read samples in order, so every global batch of that size is the same one and the loss
    falls far in a few steps (a step that does nothing, or too much, shows)."""

    def __init__(self, dataset, batch: int):
        self.dataset, self.batch = dataset, batch

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index % self.batch]


def _repeating_train_batch(provider, batch: int):
    def datasets(num_samples, configs):
        train, valid, test = provider(num_samples, configs)
        return RepeatedBatch(train, batch), valid, test
    return datasets


def pretrain_losses(argv, bitwise: bool = False, stage_p2p: Optional[bool] = None,
                    repeat_batch: Optional[int] = None) -> dict:
    """pretrain_llama.py's pretrain() in this rank, on the pool's process group. Returns
    {'losses': per-iteration 'lm loss' (empty off the last stage), 'device': where the
    parameters live, 'backend': the process group's}. ``repeat_batch``: train on the first
    that many samples over and over (the global batch size: the same batch every step)."""
    from megatron.core.enums import ModelType
    from megatron.core.models import LlamaModel
    from megatron.training import pretrain as pretrain_module
    from megatron.training.gpt_step import (
        forward_step,
        model_provider_for,
        train_valid_test_datasets_provider,
    )

    os.environ["WORLD_SIZE"] = str(dist.get_world_size())  # build_configs' world size
    seen = {}
    original_build = pretrain_module.build_model

    def build_model(*args, **kwargs):
        chunks = original_build(*args, **kwargs)
        seen["device"] = str(next(chunks[0].parameters()).device.type)
        return chunks

    pretrain_module.build_model = build_model
    try:
        with host_staged_p2p(stage_p2p), (deterministic() if bitwise else contextlib.nullcontext()):
            provider = train_valid_test_datasets_provider if repeat_batch is None else \
                _repeating_train_batch(train_valid_test_datasets_provider, repeat_batch)
            history = pretrain_module.pretrain(
                provider, model_provider_for(LlamaModel),
                ModelType.encoder_or_decoder, forward_step, argv=[str(a) for a in argv])
    finally:
        pretrain_module.build_model = original_build
    return {"losses": [h["lm loss"] for h in history if "lm loss" in h],
            "device": seen.get("device"), "backend": dist.get_backend()}


def last_stage_losses(results) -> Optional[list]:
    """The losses the last pipeline stage reported (every last-stage rank reports the same)."""
    reported = [r["losses"] for r in results if r["losses"]]
    assert reported, "no rank reported a loss"
    return reported[-1]
