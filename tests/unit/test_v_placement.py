"""The V placement of the zbv schedule: rank r's chunk 0 is virtual stage r, chunk 1 is stage
2PP-1-r. Layer ranges, first/last-stage answers, initial weights and checkpoint names equal to
one process (bitwise: the same per-layer seeds), the tied embedding's two copies on rank 0
(copied and summed locally: bitwise, one addition either way), and --pipeline-schedule."""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import (
    allreduce_tied_embedding_grads,
    build_model_chunks,
    sync_tied_embedding_weights,
)
from megatron.core.pipeline_parallel.layer_split import chunk_layer_range, stage_layer_counts
from megatron.core.pipeline_placement import LOOP, V, stage_holder, virtual_stage_of
from megatron.training.arguments import build_configs, parse_args
from megatron.training.checkpointing.layout import chunk_layer_range as saved_layer_range
from megatron.training.checkpointing.sharded_index import global_name
from tests.distributed import run_distributed
from tests.unit.test_arguments import error_of, small
from tests.unit.test_pipeline_schedules import MBS, SEQ, VOCAB, _config, _microbatches
from tests.unit.test_pipeline_schedules import _model_class as model_class


@pytest.mark.parametrize("pipe", [2, 4])
def test_v_stage_of_every_rank_and_chunk(pipe):
    for rank in range(pipe):
        assert virtual_stage_of(rank, 0, pipe, 2, V) == rank
        assert virtual_stage_of(rank, 1, pipe, 2, V) == 2 * pipe - 1 - rank
        assert virtual_stage_of(rank, 1, pipe, 2, LOOP) == pipe + rank
    for stage in range(2 * pipe):
        for placement in (LOOP, V):
            rank, chunk = stage_holder(stage, pipe, 2, placement)
            assert virtual_stage_of(rank, chunk, pipe, 2, placement) == stage
    with pytest.raises(ValueError, match="2 model chunks per pipeline rank, not 3"):
        virtual_stage_of(0, 0, pipe, 3, V)


@pytest.mark.parametrize("pipe", [2, 4])
def test_the_zbv_order_uses_the_same_v(pipe):
    from megatron.core.pipeline_parallel import zero_bubble_order as zb
    for rank in range(pipe):
        for chunk in range(2):
            stage = virtual_stage_of(rank, chunk, pipe, 2, V)
            assert zb.zbv_stage(pipe, rank, chunk) == stage
            assert tuple(zb.zbv_placement(pipe, stage)) == (rank, chunk)


@pytest.mark.parametrize("pipe", [2, 4])
def test_v_layer_ranges(pipe):
    per = 3
    layers = 2 * pipe * per
    for rank in range(pipe):
        for chunk, stage in ((0, rank), (1, 2 * pipe - 1 - rank)):
            got = chunk_layer_range(layers, pipe, rank, chunk, 2, placement=V)
            assert got == (stage * per, (stage + 1) * per)
    # The embedding and the loss counted as layers: both ends sit on rank 0, one layer each.
    got = {(r, c): chunk_layer_range(2 * pipe * 2 - 2, pipe, r, c, 2, None, None, True, True,
                                     V) for r in range(pipe) for c in range(2)}
    assert got[(0, 0)] == (0, 1) and got[(0, 1)] == (4 * pipe - 3, 4 * pipe - 2)
    assert got[(pipe - 1, 0)] == (2 * pipe - 3, 2 * pipe - 1)
    assert sorted(got.values())[0][0] == 0 and \
        all(a[1] == b[0] for a, b in zip(sorted(got.values()), sorted(got.values())[1:]))
    counts = stage_layer_counts(4 * pipe - 2, pipe, None, None, 2, True, True, V)
    assert counts == [2] + [4] * (pipe - 1)
    with pytest.raises(ValueError, match="do not apply to the V placement"):
        chunk_layer_range(layers, pipe, 0, 0, 2, 1, None, placement=V)


def test_config_schedule_rules():
    assert ModelParallelConfig().resolved_pipeline_schedule() == "1f1b"
    assert ModelParallelConfig(virtual_pipeline_model_parallel_size=2
                               ).resolved_pipeline_schedule() == "interleaved"
    assert ModelParallelConfig(pipeline_schedule="zbv", virtual_pipeline_model_parallel_size=2
                               ).resolved_pipeline_schedule() == "zbv"
    for schedule, vpp, message in [("zbv", None, "'zbv' needs virtual_pipeline_model_parallel"
                                    "_size 2, got None"),
                                   ("zb-h1", 2, "'zb-h1' needs virtual_pipeline_model_parallel"
                                    "_size None, got 2"),
                                   ("interleaved", None, "'interleaved' needs virtual"),
                                   ("gpipe", None, "'gpipe' is not one of")]:
        with pytest.raises(ValueError, match=message):
            ModelParallelConfig(pipeline_schedule=schedule,
                                virtual_pipeline_model_parallel_size=vpp)


def _transformer(*extra, world=2):
    return build_configs(parse_args(small("--pipeline-model-parallel-size", "2", *extra)),
                         world).transformer


def test_pipeline_schedule_flag_maps_to_the_config():
    t = _transformer()
    assert (t.pipeline_schedule, t.virtual_pipeline_model_parallel_size) == (None, None)
    t = _transformer("--pipeline-schedule", "zbv")
    assert (t.pipeline_schedule, t.virtual_pipeline_model_parallel_size) == ("zbv", 2)
    t = _transformer("--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "2")
    assert t.virtual_pipeline_model_parallel_size == 2  # agrees: accepted
    t = _transformer("--pipeline-schedule", "zbv", "--num-layers", "8",
                     "--num-layers-per-virtual-pipeline-stage", "2")
    assert t.virtual_pipeline_model_parallel_size == 2
    t = _transformer("--pipeline-schedule", "interleaved",
                     "--num-layers-per-virtual-pipeline-stage", "1")
    assert (t.pipeline_schedule, t.virtual_pipeline_model_parallel_size) == ("interleaved", 2)
    for name in ("1f1b", "zb-h1"):
        t = _transformer("--pipeline-schedule", name)
        assert (t.pipeline_schedule, t.virtual_pipeline_model_parallel_size) == (name, None)
    t = _transformer("--pipeline-schedule", "zbv", "--num-layers", "6",
                     "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split")
    assert t.virtual_pipeline_model_parallel_size == 2


PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("extra, world, message", [
    (PP2 + ["--pipeline-schedule", "interleaved"], 2,
     "--pipeline-schedule interleaved needs virtual pipeline stages: add "
     "--num-layers-per-virtual-pipeline-stage"),
    (PP2 + ["--pipeline-schedule", "1f1b", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     "--pipeline-schedule 1f1b runs one model chunk per pipeline rank; drop "
     "--num-layers-per-virtual-pipeline-stage"),
    (PP2 + ["--pipeline-schedule", "zb-h1", "--num-virtual-stages-per-pipeline-rank", "2"], 2,
     "--pipeline-schedule zb-h1 runs one model chunk per pipeline rank"),
    (["--pipeline-schedule", "zbv"], 1,
     "--pipeline-schedule zbv needs --pipeline-model-parallel-size >= 2, got 1."),
    (PP2 + ["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", "4",
            "--num-layers", "8"], 2,
     "--pipeline-schedule zbv places 2 model chunks per pipeline rank (in a V), but "
     "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank ask "
     "for 4; drop them."),
    (PP2 + ["--pipeline-schedule", "zbv", "--num-layers-per-virtual-pipeline-stage", "1",
            "--num-layers", "8"], 2, "(in a V), but --num-layers-per-virtual-pipeline-stage "
     "/ --num-virtual-stages-per-pipeline-rank ask for 4; drop them."),
    (PP2 + ["--pipeline-schedule", "zbv", "--num-layers", "6"], 2,
     "--pipeline-schedule zbv cuts the model into 2 x --pipeline-model-parallel-size 2 = 4 "
     "virtual stages; --num-layers 6 is not a multiple of 4."),
    (PP2 + ["--pipeline-schedule", "zbv", "--decoder-first-pipeline-num-layers", "2",
            "--decoder-last-pipeline-num-layers", "2"], 2,
     "--pipeline-schedule zbv puts the first and the last stage on pipeline rank 0"),
    (PP2 + ["--pipeline-schedule", "gpipe"], 2, "invalid choice: 'gpipe'"),
])
def test_pipeline_schedule_refusals(extra, world, message):
    assert message in error_of(small(*extra), world)


def _gpt(layers, pipe, schedule="zbv"):
    config = _config("gpt", layers, pipe, 2 if schedule == "zbv" else None,
                     pipeline_schedule=schedule)
    torch.manual_seed(42)
    return build_model_chunks(lambda **stage: model_class("gpt")(config, VOCAB, **stage),
                              config)


def _zbv_chunks_as_saved(layers, pipe):
    """Per chunk: its layer range (built and as a checkpoint records it), the stage answers
    with it current, and its tensors under their checkpoint (global) names."""
    chunks = _gpt(layers, pipe)
    out = []
    for index, chunk in enumerate(chunks):
        with ps.in_model_chunk(index):
            answers = (ps.get_virtual_pipeline_stage(), ps.is_pipeline_first_stage(),
                       ps.is_pipeline_last_stage())
        start, end = saved_layer_range(chunk)
        named = {global_name(name, start, chunk.share_embeddings_and_output_weights): t.clone()
                 for name, t in chunk.state_dict().items()}
        out.append(dict(range=(start, end), pre=chunk.pre_process, post=chunk.post_process,
                        answers=answers, named=named))
    return dict(rank=ps.get_pipeline_model_parallel_rank(), chunks=out,
                holds_ends=(ps.is_pipeline_first_stage(ignore_virtual=True),
                            ps.is_pipeline_last_stage(ignore_virtual=True)))


def _one_process(layers, seed=42):
    torch.manual_seed(seed)
    return model_class("gpt")(_config("gpt", layers), VOCAB)


@pytest.mark.parametrize("pipe", [2, 4])
def test_zbv_chunks_hold_their_v_stage_with_one_process_weights(pipe):
    layers = 2 * pipe
    ranks = run_distributed(_zbv_chunks_as_saved, world_size=pipe, tp=1, pp=pipe, vpp=2,
                            layers=layers, pipe=pipe)
    saved = {}
    for result in ranks:
        rank = result["rank"]
        assert result["holds_ends"] == (rank == 0, rank == 0)
        for chunk, stage in zip(result["chunks"], (rank, 2 * pipe - 1 - rank)):
            assert chunk["range"] == (stage, stage + 1)
            first, last = stage == 0, stage == 2 * pipe - 1
            assert chunk["answers"] == (stage, first, last)
            assert (chunk["pre"], chunk["post"]) == (first, last)
            for name, tensor in chunk["named"].items():
                if name in saved:  # only the tied output layer: a copy of the embedding
                    assert name == "embedding.word_embeddings.weight"
                    assert torch.equal(saved[name], tensor)
                saved[name] = tensor
    # A zbv checkpoint's names and values load into one process as they are: strict, equal.
    (single,) = run_distributed(_load_into_one_process, world_size=1, tp=1, layers=layers,
                                saved=saved)
    assert single["reference_equal"] and single["loaded_equal"]


def _load_into_one_process(layers, saved):
    reference = _one_process(layers).state_dict()
    model = _one_process(layers, seed=7)  # other weights, so the load is what makes them equal
    model.load_state_dict(saved, strict=True)
    loaded = model.state_dict()
    return dict(reference_equal=saved.keys() == reference.keys() and
                all(torch.equal(saved[k], reference[k]) for k in saved),
                loaded_equal=all(torch.equal(saved[k], loaded[k]) for k in saved))


def _hand_over(tensor, to_rank):
    dist.send(tensor.detach().contiguous(), ps.get_pipeline_model_parallel_ranks()[to_rank])


def _received(like, from_rank):
    tensor = torch.empty_like(like)
    dist.recv(tensor, ps.get_pipeline_model_parallel_ranks()[from_rank])
    return tensor.requires_grad_()


def _grad(param):
    return getattr(param, "main_grad", param.grad).clone()


def _zbv_tied_step_pp2(perturb, ddp):
    """One microbatch through the 4 chunks of PP=2 in V order (rank 0 chunk 0 -> rank 1
    chunk 0 -> rank 1 chunk 1 (local) -> rank 0 chunk 1, loss) and back, by hand; then the
    tied-embedding sum (finalize_model_grads under DDP, whose gradients are ``main_grad``).
    Returns every gradient, and rank 0's two tied copies' gradients and weights."""
    chunks = _gpt(4, 2)
    rank = ps.get_pipeline_model_parallel_rank()
    if rank == 0 and perturb:
        with torch.no_grad():
            chunks[1].output_layer.weight.add_(1.0)  # e.g. a checkpoint that disagrees
        sync_tied_embedding_weights(chunks)
    models = chunks
    if ddp:
        chunks = [DistributedDataParallel(c.config, DistributedDataParallelConfig(), c)
                  for c in chunks]
        models = [c.module for c in chunks]
    ((tokens, labels),) = _microbatches(1)
    shape = (SEQ, MBS, 32)
    if rank == 0:
        hidden = chunks[0](tokens)
        _hand_over(hidden, 1)
        back = _received(hidden, 1)
        models[1].set_input_tensor(back)
        chunks[1](tokens, labels=labels).mean().backward()
        _hand_over(back.grad, 1)
        hidden.backward(_received(hidden, 1))
    else:
        middle_in = _received(torch.empty(shape), 0)
        models[0].set_input_tensor(middle_in)
        middle = chunks[0](tokens)
        turn = middle.detach().requires_grad_()  # the local hand-over at the V's tip
        models[1].set_input_tensor(turn)
        up = chunks[1](tokens)
        _hand_over(up, 0)
        up.backward(_received(up, 0))
        middle.backward(turn.grad)
        _hand_over(middle_in.grad, 0)
    (finalize_model_grads if ddp else allreduce_tied_embedding_grads)(chunks)
    grads = [{n: _grad(p) for n, p in m.named_parameters()} for m in models]
    if rank != 0:
        return dict(rank=rank, grads=grads)
    weights = [m.shared_embedding_or_output_weight() for m in models]
    return dict(rank=rank, grads=grads, tied_grads=[_grad(w) for w in weights],
                tied_weights=[w.detach().clone() for w in weights])


def _one_process_grads():
    model = _one_process(4)
    ((tokens, labels),) = _microbatches(1)
    model(tokens, labels=labels).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("perturb, ddp", [(False, False), (True, False), (False, True)])
def test_zbv_tied_embedding_is_synced_and_summed_on_rank_0(perturb, ddp):
    (reference,) = run_distributed(_one_process_grads, world_size=1, tp=1)
    ranks = run_distributed(_zbv_tied_step_pp2, world_size=2, tp=1, pp=2, vpp=2,
                            perturb=perturb, ddp=ddp)
    rank0 = next(r for r in ranks if r["rank"] == 0)
    tied = reference["embedding.word_embeddings.weight"]
    assert all(torch.equal(g, tied) for g in rank0["tied_grads"])  # bitwise: one addition
    assert torch.equal(*rank0["tied_weights"])
    # Every other gradient, bitwise, under its one-process name.
    for result in ranks:
        stages = (result["rank"], 3 - result["rank"])
        for grads, stage in zip(result["grads"], stages):
            for name, grad in grads.items():
                name = global_name(name, stage, True)
                assert torch.equal(grad, reference[name]), name
