"""What a pipeline run does besides computing the right numbers: it executes the pure order,
frees sent activations, holds DDP gradient sync until each chunk's last backward, keeps GPT's
tied embedding equal on both ends, and refuses bad settings before any communication."""
import contextlib
import os

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import (
    PipelineTrace,
    build_model_chunks,
    get_forward_backward_func,
    schedule_order,
    sync_tied_embedding_weights,
)
from megatron.core.pipeline_parallel.trace import load_trace
from tests.collective_counter import count_collectives
from tests.distributed import RankFailed, run_distributed
from tests.unit.test_pipeline_schedules import (
    MBS,
    SEQ,
    VOCAB,
    _config,
    _forward_step,
    _microbatches,
    _model_class,
)


def _run(kind="llama", layers=4, pipe=2, virt=None, num_microbatches=4, trace=None,
         forward_step_func=_forward_step, config_changes=None, forward_only=False,
         shared_iterator=False):
    config = _config(kind, layers, pipe, virt)
    for key, value in (config_changes or {}).items():
        setattr(config, key, value)
    torch.manual_seed(42)
    chunks = build_model_chunks(lambda **stage: _model_class(kind)(config, VOCAB, **stage),
                                config)
    data = _microbatches(num_microbatches)
    iterators = iter(data) if shared_iterator else [iter(data) for _ in chunks]
    get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=iterators,
        model=chunks, num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
        trace=trace, forward_only=forward_only)
    return chunks


def _traced_order(pipe, virt, num_microbatches, forward_only, directory):
    trace = PipelineTrace(rank=torch.distributed.get_rank(),
                          pipeline_rank=ps.get_pipeline_model_parallel_rank())
    _run(layers=2 * pipe, pipe=pipe, virt=virt, num_microbatches=num_microbatches, trace=trace,
         forward_only=forward_only)
    path = os.path.join(directory, f"rank{trace.rank}.json")
    trace.write(path)
    events = load_trace(path)["events"]
    steps = [(e["kind"][0].upper(), e["microbatch"], e["chunk"]) for e in events
             if e["kind"] != "wait"]
    want = [(s.kind, s.microbatch, s.chunk) for s in schedule_order(
        pipe, ps.get_pipeline_model_parallel_rank(), num_microbatches, virt, forward_only)]
    waits = sum(e["kind"] == "wait" for e in events)
    return steps == want, waits, 0.0 <= trace.bubble_fraction() < 1.0


@pytest.mark.parametrize("pipe,virt,num,forward_only", [(4, None, 6, False), (2, 2, 4, False),
                                                        (4, 2, 8, False), (2, None, 3, True)])
def test_run_follows_the_pure_order_and_traces_it(pipe, virt, num, forward_only, tmp_path):
    for same_order, waits, bubble_ok in run_distributed(
            _traced_order, world_size=pipe, tp=1, pp=pipe, vpp=virt, pipe=pipe, virt=virt,
            num_microbatches=num, forward_only=forward_only, directory=str(tmp_path)):
        assert same_order and waits > 0 and bubble_ok
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}.json" for r in range(pipe)]


def _sent_activation_sizes(deallocate):
    outputs = []

    def recording_step(data_iterator, model):
        output, loss_func = _forward_step(data_iterator, model)
        outputs.append(output)
        return output, loss_func

    _run(num_microbatches=3, forward_step_func=recording_step,
         config_changes=dict(deallocate_pipeline_outputs=deallocate))
    return [o.numel() for o in outputs]


def test_sent_activations_are_freed():
    first, last = run_distributed(_sent_activation_sizes, world_size=2, tp=1, pp=2,
                                  deallocate=True)
    assert first == [1, 1, 1], "stage 0's sent activations keep only their autograd graph"
    assert last == [MBS * SEQ] * 3  # the per-token losses: never sent, never freed
    first, _ = run_distributed(_sent_activation_sizes, world_size=2, tp=1, pp=2,
                               deallocate=False)
    assert first == [SEQ * MBS * 32] * 3


def _sync_held_per_backward(pipe, virt, num_microbatches):
    """For each chunk, whether DDP sync was held while each microbatch's gradient reached the
    chunk's first parameter."""
    held = {}
    seen = {}

    def hold_for(chunk):
        @contextlib.contextmanager
        def no_sync():
            held[chunk] = True
            yield
            held[chunk] = False
        return no_sync

    chunks_n = virt or 1
    config_changes = dict(no_sync_func=[hold_for(c) for c in range(chunks_n)])

    def step_with_hooks(data_iterator, model):
        chunk = ps.get_virtual_pipeline_model_parallel_rank() or 0
        param = next(model.parameters())
        if not getattr(param, "_hooked", False):
            param._hooked = True
            param.register_hook(lambda g, c=chunk: seen.setdefault(c, []).append(held[c]) or g)
        return _forward_step(data_iterator, model)

    _run(layers=2 * pipe, pipe=pipe, virt=virt, num_microbatches=num_microbatches,
         forward_step_func=step_with_hooks, config_changes=config_changes)
    return seen


@pytest.mark.parametrize("pipe,virt,num", [(1, None, 3), (2, None, 3), (2, 2, 4)])
def test_gradient_sync_held_until_last_microbatch(pipe, virt, num):
    for seen in run_distributed(_sync_held_per_backward, world_size=pipe, tp=1, pp=pipe,
                                vpp=virt, pipe=pipe, virt=virt, num_microbatches=num):
        assert set(seen) == set(range(virt or 1))
        for flags in seen.values():
            assert flags == [True] * (num - 1) + [False]


def _tied_weights_after_sync():
    config = _config("gpt", 4, 2)
    torch.manual_seed(42)
    (chunk,) = build_model_chunks(lambda **stage: _model_class("gpt")(config, VOCAB, **stage),
                                  config)
    weight = chunk.shared_embedding_or_output_weight()
    if ps.is_pipeline_last_stage():
        with torch.no_grad():
            weight.add_(1.0)  # e.g. a checkpoint that disagrees: the first stage wins
    sync_tied_embedding_weights([chunk])
    return weight.detach().clone()


def test_tied_embedding_copies_are_made_equal():
    first, last = run_distributed(_tied_weights_after_sync, world_size=2, tp=1, pp=2)
    assert torch.equal(first, last)


def _bad_run(virt, num_microbatches, shared_iterator=False):
    with count_collectives() as counts:
        try:
            _run(layers=4, pipe=2, virt=virt, num_microbatches=num_microbatches,
                 shared_iterator=shared_iterator)
        except ValueError as exc:
            return str(exc), counts["p2p"]
    return None, counts["p2p"]


def test_bad_microbatch_count_fails_before_communicating():
    for message, p2p_calls in run_distributed(_bad_run, world_size=2, tp=1, pp=2, vpp=2,
                                              virt=2, num_microbatches=3):
        assert "multiple of the pipeline-model-parallel size" in message
        assert p2p_calls == 0


def test_interleaving_refuses_one_shared_data_iterator():
    for message, p2p_calls in run_distributed(_bad_run, world_size=2, tp=1, pp=2, vpp=2,
                                              virt=2, num_microbatches=2, shared_iterator=True):
        assert "list of data iterators, one per model chunk" in message
        assert p2p_calls == 0


def _bad_layers():
    _config("llama", 5, 2)


def test_indivisible_layers_fail_with_a_clear_message():
    with pytest.raises(RankFailed, match="num_layers \\(5\\) cannot be split evenly"):
        run_distributed(_bad_layers, world_size=2, tp=1, pp=2)
