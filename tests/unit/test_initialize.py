"""Starting a run without torchrun (a world of one) and with it, and the seeds."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str, **env):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env={**clean, "MEGATRON_DEVICE": "cpu", **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_plain_process_gets_a_world_of_one():
    result = _python("""
        import torch, torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.training.initialize import initialize_megatron
        initialize_megatron(seed=7)
        print(dist.get_world_size(), dist.get_backend(), ps.get_data_parallel_world_size(),
              torch.initial_seed())
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "gloo", "1", "7"]


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_layout_that_does_not_divide_the_world_is_refused():
    result = _python("""
        from megatron.training.initialize import initialize_megatron
        initialize_megatron(tensor_model_parallel_size=2)
    """)
    assert result.returncode != 0
    assert ("world size 1 is not divisible by tensor-model-parallel-size 2 x "
            "context-parallel-size 1 x pipeline-model-parallel-size 1 = 2" in result.stderr)


def _seeds(seed):
    import random

    import numpy as np
    import torch

    from megatron.core import parallel_state as ps
    from megatron.training.initialize import seed_for_model_init, set_random_seeds

    set_random_seeds(seed)
    drawn = (random.random(), float(np.random.rand()), torch.rand(1).item())
    seed_for_model_init(seed)
    return ps.get_pipeline_model_parallel_rank(), drawn, torch.rand(1).item()


def test_seeds_differ_per_pipeline_stage_but_model_init_does_not():
    (r0, drawn0, init0), (r1, drawn1, init1) = run_distributed(_seeds, world_size=2, pp=2,
                                                                seed=5)
    assert (r0, r1) == (0, 1)
    assert drawn0 != drawn1  # seed + 100 x pipeline rank, as Megatron
    assert init0 == init1


def test_seed_must_be_positive():
    with pytest.raises(Exception, match="--seed must be > 0"):
        run_distributed(_seeds, world_size=1, tp=1, seed=0)


def test_distributed_timeout_flag_reaches_the_training_config():
    from megatron.training.arguments import ConfigError, build_configs, parse_args
    from tests.unit.test_arguments import small

    assert build_configs(parse_args(small()), 1).training.distributed_timeout_minutes == 10
    configs = build_configs(parse_args(small("--distributed-timeout-minutes", "45")), 1)
    assert configs.training.distributed_timeout_minutes == 45
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes must be >= 1, got 0"):
        build_configs(parse_args(small("--distributed-timeout-minutes", "0")), 1)


def _capture_init_process_group(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kwargs: calls.append((backend, kwargs)))
    for key, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="1", TORCHELASTIC_RESTART_COUNT="0").items():
        monkeypatch.setenv(key, value)
    return calls


def test_timeout_and_device_id_reach_init_process_group(monkeypatch):
    import datetime

    import torch

    from megatron.core import device
    from megatron.training.initialize import initialize_distributed

    calls = _capture_init_process_group(monkeypatch)
    monkeypatch.delenv(device.DEVICE_ENV, raising=False)
    monkeypatch.delenv(device.BACKEND_ENV, raising=False)
    monkeypatch.setattr(device, "device_type", lambda: "cpu")
    initialize_distributed(timeout_minutes=7)
    assert calls == [("gloo", {"timeout": datetime.timedelta(minutes=7)})]  # no device_id
    # On CUDA with nccl: this rank's GPU, so nccl makes its communicator at once.
    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    monkeypatch.setattr(device, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(device, "configure_cuda_math", lambda: None)
    initialize_distributed(timeout_minutes=3)
    assert calls[1] == ("nccl", {"timeout": datetime.timedelta(minutes=3),
                                 "device_id": torch.device("cuda", 1)})


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_tensor_parallel_on_cuda_without_max_connections_is_one_error_line(tmp_path):
    """pretrain() refuses TP on CUDA without CUDA_DEVICE_MAX_CONNECTIONS=1 before any CUDA
    work: one 'error:' line, exit 2, no traceback (CUDA is pretended: the check comes first)."""
    result = _python("""
        import sys
        from megatron.core import device
        from megatron.core.enums import ModelType
        from megatron.training.pretrain import pretrain
        from tests.unit.test_arguments import small
        device.device_type = lambda: "cuda"
        device._check_device_type = lambda *a, **k: None
        pretrain(None, None, ModelType.encoder_or_decoder, None,
                 argv=small("--tensor-model-parallel-size", "2", "--device", "cuda"))
    """, WORLD_SIZE="2", CUDA_DEVICE_MAX_CONNECTIONS="8")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tensor parallelism (TP=2) on CUDA "
                                                   "needs CUDA_DEVICE_MAX_CONNECTIONS=1"), lines


_SLOW_INDEX_BUILD = """
    import hashlib, sys, time
    import numpy as np, torch, torch.distributed as dist
    from megatron.core.datasets import gpt_dataset
    from megatron.training.initialize import initialize_megatron
    init_kwargs, real_init = {{}}, dist.init_process_group
    def init_spy(*args, **kwargs):  # the timeout the world group is made with (public API)
        init_kwargs.update(kwargs)
        return real_init(*args, **kwargs)
    dist.init_process_group = init_spy
    initialize_megatron(seed=1, distributed_timeout_minutes={minutes})
    real_build = gpt_dataset._build_and_save
    def slow_build(*args):
        time.sleep({sleep})  # rank 0 builds the indices while the others wait
        real_build(*args)
    gpt_dataset._build_and_save = slow_build
    description = dict(dataset_path="D", split="train", document_range=[0, 3],
                       num_samples=4, seq_length=4, seed=1)
    arrays = gpt_dataset.load_or_build_indices(np.array([5, 7, 3], dtype=np.int32),
                                               description, {cache!r})
    world = init_kwargs["timeout"]
    digest = hashlib.sha1(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
    print(dist.get_rank(), digest.hexdigest(), world.total_seconds(), flush=True)
    dist.destroy_process_group()  # left to exit, gloo's threads may abort the process
"""


def _two_ranks(code: str):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                              env={**clean, "MEGATRON_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
                                   "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    return [p.communicate(timeout=120) + (p.returncode,) for p in procs]


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_ranks_wait_for_rank_0_index_build_under_the_configured_timeout(tmp_path):
    """Rank 1 waits for rank 0's slow index build; the wait (gpt_dataset._tell_others, a
    broadcast on the world group) is bounded by that group's timeout, which is
    --distributed-timeout-minutes (here 5 minutes)."""
    results = _two_ranks(_SLOW_INDEX_BUILD.format(minutes=5, sleep=2, cache=str(tmp_path)))
    for out, err, code in results:
        assert code == 0, err
    (r0, n0, timeout0), (r1, n1, timeout1) = [out.split() for out, _, _ in results]
    assert (r0, r1) == ("0", "1") and n0 == n1  # rank 1 loaded what rank 0 built, byte for byte
    assert float(timeout0) == float(timeout1) == 300.0
