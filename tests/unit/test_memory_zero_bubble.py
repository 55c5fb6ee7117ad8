"""The memory estimate of the zero-bubble schedules (zb-h1, zbv) against real runs.

A tiny LLaMA at PP=2 (gloo, fp32, CPU) runs each schedule through the pipeline executor; after
every F, B and W step each rank measures what it holds for backward: the unique storages of
the tensors autograd saved that are still alive (``saved_tensors_hooks`` with weak references,
parameters excluded) together with the tensors the pending ``WeightGradStore`` records keep.
The estimate walks the same order (``memory.schedules.live_bytes_per_step``) with the chunk's
activations from F to B and its W records from B to W. Both are exact byte counts of the same
tensors, so they are compared exactly, step by step, but for one thing the estimate leaves
out (as the 1F1B estimate does): after a B the executor still references that microbatch's
RECEIVED input (the chunk's ``set_input_tensor`` keeps the last one, the loop's locals the one
of the latest B) until a later step replaces it. So on a rank whose chunks receive their input
the measurement may exceed the estimate by 0, 1 or 2 such [s, b, h] tensors, never more and
never less; the first stage of zb-h1 (which receives nothing) is exact at every step.
"""
import contextlib
import gc
import weakref

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import (
    build_model_chunks,
    get_forward_backward_func,
)
from megatron.core.pipeline_parallel import schedules as schedules_module
from megatron.core.pipeline_parallel.schedule_order import schedule_order
from megatron.core.tensor_parallel.weight_grad_store import WeightGradStore
from megatron.training.memory.activations import (
    ActivationSetup,
    chunk_bytes,
    stage_activations,
)
from megatron.training.memory.schedules import (
    live_bytes_per_step,
    weight_grad_record_bytes,
)
from tests.distributed import run_distributed
from tests.unit.test_pipeline_schedules import (
    MBS,
    SEQ,
    VOCAB,
    _config,
    _forward_step,
    _microbatches,
    _model_class,
)

TRACE_KINDS = {"forward": "F", "backward": "B", "weight": "W"}


class _MemoryProbe:
    """Stands in for the executor's PipelineTrace: after each step, the bytes held."""

    def __init__(self, exclude, stores):
        self.saved, self.exclude, self.stores = [], exclude, stores
        self.steps, self.held = [], []

    def pack(self, tensor):
        self.saved.append(weakref.ref(tensor))
        return tensor

    def measure(self) -> int:
        gc.collect()  # what only reference cycles keep is garbage, not memory held
        tensors = [ref() for ref in self.saved]
        tensors += [t for store in self.stores for record in store._records
                    for t in record.held]
        storages = {}
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in self.exclude:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    @contextlib.contextmanager
    def span(self, kind, microbatch=None, chunk=None):
        yield
        if kind in TRACE_KINDS:
            self.steps.append((TRACE_KINDS[kind], microbatch, chunk))
            self.held.append(self.measure())


def _measured_run(schedule, layers, num_microbatches, tp=1, **extra):
    virt = 2 if schedule == "zbv" else None
    config = _config("llama", layers, 2, virt, tp, pipeline_schedule=schedule, **extra)
    chunks = build_model_chunks(lambda **stage: _model_class("llama")(config, VOCAB, **stage),
                                config)
    exclude = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    stores = []

    class RecordedStore(WeightGradStore):
        def __init__(self):
            super().__init__()
            stores.append(self)

    probe = _MemoryProbe(exclude, stores)
    data = _microbatches(num_microbatches)
    # Fresh copies: only autograd holds the token ids, as with a real data iterator.
    iterators = [(tuple(t.clone() for t in batch) for batch in data) for _ in chunks]
    original, schedules_module.WeightGradStore = schedules_module.WeightGradStore, RecordedStore
    try:
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
            get_forward_backward_func()(
                forward_step_func=_forward_step,
                data_iterator=iterators if virt else iterators[0], model=chunks,
                num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
                trace=probe)
    finally:
        schedules_module.WeightGradStore = original
    return dict(rank=ps.get_pipeline_model_parallel_rank(), steps=probe.steps,
                held=probe.held, config=config)


def _estimate(config, rank, num_microbatches):
    setup = ActivationSetup(SEQ, MBS, 4, VOCAB, device="cpu")
    chunks = range(config.virtual_pipeline_model_parallel_size or 1)
    order = schedule_order(2, rank, num_microbatches,
                           config.virtual_pipeline_model_parallel_size,
                           schedule=config.pipeline_schedule)
    per_step = live_bytes_per_step(
        order, [chunk_bytes(config, setup, rank, c) for c in chunks],
        [weight_grad_record_bytes(config, setup, rank, c) for c in chunks])
    return order, per_step, stage_activations(config, setup, rank, num_microbatches)


@pytest.mark.parametrize("schedule,layers,num_microbatches",
                         [("zb-h1", 2, 2), pytest.param("zb-h1", 2, 5, marks=pytest.mark.slow),
                          pytest.param("zbv", 4, 4, marks=pytest.mark.slow),
                          pytest.param("zbv", 4, 5, marks=pytest.mark.slow)])
def test_estimate_equals_what_each_step_holds(schedule, layers, num_microbatches):
    _assert_each_step_held(schedule, layers, num_microbatches)


@pytest.mark.parametrize("qk_layernorm", [True, False], ids=["latent_norms", "no_norms"])
def test_multi_latent_attention_estimate_equals_what_each_step_holds(qk_layernorm):
    """Its down projections (replicated) and up projections defer their W too."""
    _assert_each_step_held("zb-h1", 2, 2, multi_latent_attention=True, num_query_groups=None,
                           q_lora_rank=12, kv_lora_rank=16, qk_head_dim=8,
                           qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=qk_layernorm)


def _assert_each_step_held(schedule, layers, num_microbatches, **extra):
    for run in run_distributed(_measured_run, world_size=2, tp=1, pp=2,
                               vpp=2 if schedule == "zbv" else None, schedule=schedule,
                               layers=layers, num_microbatches=num_microbatches, **extra):
        order, per_step, stage = _estimate(run["config"], run["rank"], num_microbatches)
        assert run["steps"] == [(s.kind, s.microbatch, s.chunk) for s in order]
        received = 4 * SEQ * MBS * run["config"].hidden_size  # one [s, b, h] fp32 input
        extra = [m - e for m, e in zip(run["held"], per_step)]
        assert all(x in (0, received, 2 * received) for x in extra), (run["rank"], extra)
        if run["rank"] == 0 and schedule == "zb-h1":  # the first stage receives nothing
            assert extra == [0] * len(extra)
        assert stage.stored_bytes == max(per_step)
        assert 0 <= max(run["held"]) - stage.stored_bytes <= 2 * received


# --- pure: no processes ------------------------------------------------------------------------

def _pure_config(schedule, pipe=2, layers=8, **extra):
    return _config("llama", layers, pipe, 2 if schedule == "zbv" else None, 1,
                   pipeline_schedule=schedule, **extra)


def test_zbv_puts_the_embedding_and_the_loss_on_rank_0():
    setup = ActivationSetup(SEQ, MBS, 4, VOCAB, device="cpu")
    v, loop = _pure_config("zbv"), _pure_config(None)
    # Rank 0 chunk 1 is the last virtual stage under the V: the loss's activations are there.
    assert chunk_bytes(v, setup, 0, 1) > chunk_bytes(v, setup, 1, 1)
    assert weight_grad_record_bytes(v, setup, 0, 1) - weight_grad_record_bytes(v, setup, 1, 1) \
        == 4 * SEQ * MBS * (VOCAB + v.hidden_size)  # the output layer's logits grad and input
    # Chunk 0 of rank 0 is the embedding stage in both placements (half the layers under V).
    assert chunk_bytes(v, setup, 0, 0) > chunk_bytes(v, setup, 1, 0)
    assert loop.virtual_pipeline_model_parallel_size is None


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_zero_bubble_peak_holds_activations_and_w_records(schedule):
    """The peak: activations of microbatches between F and B plus W records between B and W;
    never more (chunk, microbatch) than the order's max_in_flight (F to W)."""
    from megatron.core.pipeline_parallel.schedule_order import max_in_flight

    setup = ActivationSetup(SEQ, MBS, 4, VOCAB, device="cpu")
    for pipe in (2, 4):
        config = _pure_config(schedule, pipe)
        for m in (2 * pipe, 2 * pipe + 1, 4 * pipe):
            for rank in range(pipe):
                stage = stage_activations(config, setup, rank, m)
                order = schedule_order(pipe, rank, m, config.virtual_pipeline_model_parallel_size,
                                       schedule=schedule)
                assert stage.in_flight + stage.deferred <= max_in_flight(order)
                chunks = range(config.virtual_pipeline_model_parallel_size or 1)
                per_step = live_bytes_per_step(
                    order, [chunk_bytes(config, setup, rank, c) for c in chunks],
                    [weight_grad_record_bytes(config, setup, rank, c) for c in chunks])
                assert stage.stored_bytes == max(per_step) and per_step[-1] == 0
                assert 0 <= stage.weight_grad_bytes <= stage.stored_bytes


def test_1f1b_and_interleaved_hold_no_w_records():
    setup = ActivationSetup(SEQ, MBS, 4, VOCAB, device="cpu")
    for schedule, virt in ((None, None), ("1f1b", None), ("interleaved", 2), (None, 2)):
        config = _config("llama", 8, 2, virt, 1, pipeline_schedule=schedule)
        for rank in (0, 1):
            stage = stage_activations(config, setup, rank, 8)
            assert stage.weight_grad_bytes == 0 and stage.deferred == 0


def test_report_names_the_deferred_w_inputs():
    from megatron.training.memory.base import OptimizerSetup
    from megatron.training.memory.estimate import estimate_memory, format_report

    config = _pure_config("zb-h1", 2, 4)
    estimate = estimate_memory(config, padded_vocab_size=VOCAB, seq_length=SEQ,
                               micro_batch_size=MBS, num_microbatches=4,
                               setup=OptimizerSetup(data_parallel_size=1), device="cpu")
    last = estimate.stages[1].activations
    assert last.deferred >= 1 and last.weight_grad_bytes > 0
    assert "deferred weight-gradient inputs" in format_report(estimate)
