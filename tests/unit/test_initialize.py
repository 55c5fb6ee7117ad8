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


def test_layout_that_does_not_divide_the_world_is_refused():
    result = _python("""
        from megatron.training.initialize import initialize_megatron
        initialize_megatron(tensor_model_parallel_size=2)
    """)
    assert result.returncode != 0
    assert "world size (1) is not divisible by tensor x pipeline" in result.stderr


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
