"""megatron.core.device on a real GPU: one GPU per rank (unless sharing is asked for), TF32,
nccl's device_id and timeout, build_model giving the CUDA generator back, and RNG states
saved on CPU resumed on CUDA. The CPU tier checks the same code with a pretended device
(tests/unit/test_device.py, test_initialize.py, test_build_model_rng.py, test_rng_state.py)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.core import device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, **env) -> dict:
    """``code`` in a fresh process on CUDA (a world of one, nccl); its last line is JSON."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                          device.BACKEND_ENV, device.SHARED_GPU_ENV, device.TF32_ENV)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env={**clean, "MEGATRON_DEVICE": "cuda",
                               "CUDA_DEVICE_MAX_CONNECTIONS": "1", **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_rank_beyond_the_visible_gpus_is_refused(monkeypatch):
    monkeypatch.delenv(device.SHARED_GPU_ENV, raising=False)
    monkeypatch.delenv(device.DEVICE_ENV, raising=False)
    # set_device turns TF32 on: tests/conftest.py puts the process's settings back.
    count = torch.cuda.device_count()
    with pytest.raises(device.DeviceSetupError, match=f"LOCAL_RANK={count} but this node has "
                                                      f"only {count} visible GPU"):
        device.set_device(count)
    monkeypatch.setenv(device.SHARED_GPU_ENV, "1")
    device.set_device(count)  # shared on purpose: wraps around
    assert torch.cuda.current_device() == 0


def test_tf32_follows_megatron_allow_tf32():
    code = """
        import json, torch
        from megatron.core import device
        device.set_device(0)
        print(json.dumps([torch.backends.cuda.matmul.allow_tf32,
                          torch.backends.cudnn.allow_tf32]))
    """
    assert _run(code) == [True, True]
    assert _run(code, MEGATRON_ALLOW_TF32="0") == [False, False]


def test_nccl_group_is_bound_to_the_gpu_with_the_configured_timeout():
    result = _run("""
        import json, torch, torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.training.initialize import initialize_megatron
        init_kwargs, real_init = {}, dist.init_process_group
        def init_spy(*args, **kwargs):  # what the world group is made with (public API)
            init_kwargs.update(kwargs)
            return real_init(*args, **kwargs)
        dist.init_process_group = init_spy
        initialize_megatron(seed=1234, distributed_timeout_minutes=7)
        world = dist.group.WORLD
        print(json.dumps({
            "backend": dist.get_backend(),
            "bound": str(world.bound_device_id),
            "world_timeout": init_kwargs["timeout"].total_seconds(),
            "groups_timeout": ps.get_distributed_timeout().total_seconds()}))
    """)
    assert result == {"backend": "nccl", "bound": "cuda:0", "world_timeout": 420.0,
                      "groups_timeout": 420.0}


def test_build_model_gives_the_cuda_generator_back():
    """After build_model the CUDA dropout stream is still seed + 100 * pp_rank (torch.manual_seed
    in the weight init reseeds CUDA too) and the tracker's stream is untouched."""
    result = _run("""
        import json, torch
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.models import LlamaModel
        from megatron.core.tensor_parallel.random import get_rng_tracker
        from megatron.training.initialize import initialize_megatron
        from megatron.training.training import build_model
        from tests.unit.test_data_parallel import VOCAB, _config
        initialize_megatron(seed=1234)
        expected = torch.cuda.get_rng_state()
        tracker = get_rng_tracker().get_states()
        config = _config()
        build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                    DistributedDataParallelConfig(), seed=42)
        after = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(1234)  # what initialize_megatron seeded (pp_rank 0)
        print(json.dumps({
            "unchanged": torch.equal(after, expected),
            "is_seed": torch.equal(expected, torch.cuda.get_rng_state()),
            "tracker": all(torch.equal(v, get_rng_tracker().get_states()[k])
                           for k, v in tracker.items())}))
    """)
    assert result == {"unchanged": True, "is_seed": True, "tracker": True}


def test_rng_state_saved_on_cpu_resumes_on_cuda():
    """A CPU checkpoint's generator states do not fit CUDA's: reseeded, dropout works, and
    two restores give the same masks."""
    result = _run("""
        import json, torch
        from megatron.core.tensor_parallel.random import get_rng_tracker
        from megatron.training.checkpointing import rng_state
        from megatron.training.initialize import initialize_megatron
        initialize_megatron(seed=1234)
        state = rng_state.capture_rng_state()
        cpu_saved = {k: v for k, v in state.items() if k != "cuda_rng_state"}
        cpu_saved["device_type"] = "cpu"
        cpu_saved["rng_tracker_states"] = {k: torch.get_rng_state()
                                           for k in state["rng_tracker_states"]}
        masks = []
        for _ in range(2):
            rng_state.restore_rng_state(cpu_saved, 1234, 10)
            x = torch.ones(1024, device="cuda")
            with get_rng_tracker().fork():
                sharded = torch.nn.functional.dropout(x, 0.5)
            masks.append((sharded, torch.nn.functional.dropout(x, 0.5)))
        torch.cuda.manual_seed(1234 + 10)  # Megatron's seed from --seed + iteration, pp_rank 0
        megatron_mask = torch.nn.functional.dropout(torch.ones(1024, device="cuda"), 0.5)
        print(json.dumps({
            "same": all(torch.equal(a, b) for a, b in zip(*masks)),
            "megatron_seed": torch.equal(masks[0][1], megatron_mask),
            "dropped": float((masks[0][1] == 0).float().mean())}))
    """)
    assert result["same"] and result["megatron_seed"] and 0.4 < result["dropped"] < 0.6
