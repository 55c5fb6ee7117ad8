"""Checkpointed random-generator state: restored exactly on the device type that saved it;
reseeded deterministically (Megatron's seeds, from --seed and the iteration) where it was
saved on another device type, instead of crashing at the first dropout."""
import contextlib
import io

import torch

from tests.distributed import run_distributed

SEED, ITERATION = 1234, 50
NAME = "model-parallel-rng"
GPU_STATE_BYTES = 16  # a CUDA (Philox) generator state; a CPU one is 5056 bytes


def _generator_state(seed):
    return torch.Generator().manual_seed(seed).get_state()


def _dropout_masks():
    from megatron.core.tensor_parallel.random import get_rng_tracker

    with get_rng_tracker().fork():
        sharded = torch.nn.functional.dropout(torch.ones(256), 0.5)
    return sharded, torch.nn.functional.dropout(torch.ones(256), 0.5)


def _restore_foreign_states():
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_rng_tracker, model_parallel_manual_seed
    from megatron.training.checkpointing import rng_state

    tp_rank = ps.get_tensor_model_parallel_rank()
    model_parallel_manual_seed(SEED)
    _dropout_masks()  # advance the streams so "restored" and "reseeded" differ
    saved = rng_state.capture_rng_state()
    cpu_at_save = saved["torch_rng_state"].clone()
    out = {"device_type": saved["device_type"]}

    # Same device type: restored exactly.
    expected_masks = _dropout_masks()
    rng_state.restore_rng_state(saved, SEED, ITERATION)
    out["exact"] = all(torch.equal(a, b) for a, b in zip(_dropout_masks(), expected_masks))

    wrong = {k: torch.zeros(GPU_STATE_BYTES, dtype=torch.uint8)
             for k in saved["rng_tracker_states"]}
    cases = {
        # A GPU checkpoint resumed on CPU.
        "gpu": dict(saved, device_type="cuda", rng_tracker_states=wrong,
                    cuda_rng_state=torch.zeros(GPU_STATE_BYTES, dtype=torch.uint8)),
        # Written before the device type was recorded: a cuda_rng_state means a GPU run.
        "old_gpu": {**{k: v for k, v in saved.items() if k != "device_type"},
                    "rng_tracker_states": wrong,
                    "cuda_rng_state": torch.zeros(GPU_STATE_BYTES, dtype=torch.uint8)},
        # Labelled cpu, but the tracker states are shaped for another device type.
        "wrong_size": dict(saved, rng_tracker_states=wrong),
    }
    reseeded = SEED + ITERATION + 100 * ps.get_pipeline_model_parallel_rank()
    for name, state in cases.items():
        rng_state._warned = False
        err = io.StringIO()
        masks = []
        with contextlib.redirect_stderr(err):
            for _ in range(2):  # two restores: the same masks
                rng_state.restore_rng_state(state, SEED, ITERATION)
                tracker = get_rng_tracker().get_states()
                cpu = torch.get_rng_state()
                masks.append(_dropout_masks())
        out[name] = {
            "deterministic": all(torch.equal(a, b) for a, b in zip(*masks)),
            "tracker_is_megatron_seed": torch.equal(
                tracker[NAME], _generator_state(reseeded + 2718 + tp_rank)),
            "cpu_restored": torch.equal(cpu, cpu_at_save),
            "sharded_mask": masks[0][0].tolist(),
            "warnings": err.getvalue().count("warning:"),
            "warning": err.getvalue(),
        }
    return out


def test_rng_state_saved_on_another_device_type_is_reseeded_not_crashing():
    results = run_distributed(_restore_foreign_states, world_size=2, tp=2)
    for rank, r in enumerate(results):
        assert r["device_type"] == "cpu"
        assert r["exact"]
        for case in ("gpu", "old_gpu", "wrong_size"):
            c = r[case]
            assert c["deterministic"] and c["tracker_is_megatron_seed"] and c["cpu_restored"], \
                (rank, case, c)
            # One warning, on rank 0 only, however often the state is restored.
            assert c["warnings"] == (1 if rank == 0 else 0), (rank, case, c["warning"])
    assert "saved on cuda and does not fit cpu" in results[0]["gpu"]["warning"]
    assert "--seed 1234 and iteration 50" in results[0]["gpu"]["warning"]
    # The tensor-parallel stream differs per TP rank, as Megatron's seeds make it.
    assert results[0]["gpu"]["sharded_mask"] != \
        results[1]["gpu"]["sharded_mask"]
