"""Pipeline schedules against a single process doing gradient accumulation over the same
microbatches: every loss and every parameter gradient.

Bitwise for LLaMA (untied): each stage runs the same ops in the same order as the single
process, gradients of a parameter accumulate over microbatches in the same order, and the
gradient arriving at a stage boundary is the same sum of the same two terms. GPT's tied
embedding is the exception: one process adds the embedding and output-layer contributions per
microbatch, the pipeline sums each over all microbatches on its own stage and then adds the
two, so with more than one microbatch that one gradient differs by rounding: at most 1e-6 of
the tensor's largest entry (relative to each entry it can be larger where the two terms cancel).
TP=2 x PP=2 is compared at 1e-5 absolute, as in the models issue (TP changes sum order).
"""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.models import GPTModel, LlamaModel, llama_config
from megatron.core.models.tp_sharding import merge_state_dicts, select_layers
from megatron.core.pipeline_parallel import (
    allreduce_tied_embedding_grads,
    build_model_chunks,
    get_forward_backward_func,
)
from megatron.core.transformer import TransformerConfig
from tests.distributed import run_distributed

VOCAB, SEQ, MBS = 64, 16, 2
TP_TOL = 1e-5
TIED_RTOL = 1e-6


def _config(kind, layers, pipe=1, virt=None, tp=1, **extra):
    sizes = dict(num_layers=layers, hidden_size=32, max_position_embeddings=SEQ,
                 tensor_model_parallel_size=tp, pipeline_model_parallel_size=pipe,
                 virtual_pipeline_model_parallel_size=virt, **extra)
    if kind == "llama":
        return llama_config(**{**dict(num_attention_heads=8, num_query_groups=4,
                                      ffn_hidden_size=48), **sizes})
    return TransformerConfig(num_attention_heads=4, attention_dropout=0.0, hidden_dropout=0.0,
                             **sizes)


def _model_class(kind):
    return LlamaModel if kind == "llama" else GPTModel


def _microbatches(num):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
             torch.randint(0, VOCAB, (MBS, SEQ), generator=g)) for _ in range(num)]


def _loss_func(per_token_loss):
    loss = per_token_loss.mean()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    return model(tokens, labels=labels), _loss_func


def _reference(kind, layers, num_microbatches):
    """One process, the whole model, gradient accumulation."""
    torch.manual_seed(42)
    model = _model_class(kind)(_config(kind, layers), VOCAB)
    losses = []
    for tokens, labels in _microbatches(num_microbatches):
        loss = model(tokens, labels=labels).mean()
        (loss / num_microbatches).backward()
        losses.append(loss.detach())
    return losses, {name: p.grad for name, p in model.named_parameters()}


def _pipelined(kind, layers, pipe, virt, num_microbatches, tp=1, **extra):
    config = _config(kind, layers, pipe, virt, tp, **extra)
    config.finalize_model_grads_func = allreduce_tied_embedding_grads
    torch.manual_seed(42)
    chunks = build_model_chunks(
        lambda **stage: _model_class(kind)(config, VOCAB, **stage), config)
    data = _microbatches(num_microbatches)
    iterators = [iter(data) for _ in chunks]
    results = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iterators if virt else iterators[0],
        model=chunks, num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS)
    stages = []
    for chunk in chunks:
        stages.append(dict(layer_range=(chunk.decoder.layer_offset,
                                        chunk.decoder.layer_offset + len(chunk.decoder.layers)),
                           pre_process=chunk.pre_process, post_process=chunk.post_process,
                           tied=chunk.share_embeddings_and_output_weights,
                           grads={n: p.grad for n, p in chunk.named_parameters()},
                           sequence_parallel=[n for n, p in chunk.named_parameters()
                                              if getattr(p, "sequence_parallel", False)]))
    return dict(losses=[r["lm loss"] for r in results], stages=stages,
                pp_rank=ps.get_pipeline_model_parallel_rank(),
                tp_rank=ps.get_tensor_model_parallel_rank())


def _expected(stage, reference_grads):
    return select_layers(reference_grads, stage["layer_range"], stage["pre_process"],
                         stage["post_process"], stage["tied"])


def _check_against_reference(kind, layers, pipe, virt, num_microbatches, **extra):
    ref_losses, ref_grads = run_distributed(_reference, world_size=1, tp=1, kind=kind, layers=layers,
                                            num_microbatches=num_microbatches)[0]
    ranks = run_distributed(_pipelined, world_size=pipe, tp=1, pp=pipe, vpp=virt, kind=kind,
                            layers=layers, pipe=pipe, virt=virt,
                            num_microbatches=num_microbatches, **extra)
    last = ranks[-1]
    assert len(last["losses"]) == num_microbatches
    for got, want in zip(last["losses"], ref_losses):
        assert torch.equal(got, want)
    assert all(not r["losses"] for r in ranks[:-1]), "loss dicts only on the last stage"
    covered = set()
    for rank in ranks:
        for stage in rank["stages"]:
            want = _expected(stage, ref_grads)
            assert stage["grads"].keys() == want.keys()
            for name, grad in stage["grads"].items():
                tied = stage["tied"] and "word_embeddings" in name or (
                    stage["tied"] and name == "output_layer.weight")
                if tied and num_microbatches > 1 and pipe > 1:
                    scale = want[name].abs().max().item()
                    torch.testing.assert_close(grad, want[name], rtol=0,
                                               atol=TIED_RTOL * scale)
                else:
                    assert torch.equal(grad, want[name]), \
                        f"PP rank {rank['pp_rank']} {name} differs"
            covered.update(range(*stage["layer_range"]))
    assert covered == set(range(layers)), "every layer is on exactly one stage"


@pytest.mark.parametrize("pipe", [2, 4])
@pytest.mark.parametrize("multiple", ["one", "pp", "2pp+1"])
def test_1f1b_equals_single_process(pipe, multiple):
    num = {"one": 1, "pp": pipe, "2pp+1": 2 * pipe + 1}[multiple]
    _check_against_reference("llama", 4, pipe, None, num)


@pytest.mark.parametrize("pipe,num_microbatches", [(2, 2), (2, 4), (2, 6), (4, 4), (4, 8)])
def test_interleaved_equals_single_process(pipe, num_microbatches):
    _check_against_reference("llama", 2 * pipe, pipe, 2, num_microbatches)


@pytest.mark.parametrize("pipe,virt,num_microbatches", [(2, None, 1), (2, None, 5),
                                                         (2, 2, 4)])
def test_gpt_tied_embedding_equals_single_process(pipe, virt, num_microbatches):
    _check_against_reference("gpt", 4, pipe, virt, num_microbatches)


@pytest.mark.parametrize("virt,extra", [
    (None, dict(num_layers_in_first_pipeline_stage=3)),
    (2, dict(account_for_embedding_in_pipeline_split=True,
             account_for_loss_in_pipeline_split=True)),
])
def test_uneven_splits_equal_single_process(virt, extra):
    _check_against_reference("llama", 4 if virt is None else 6, 2, virt, 4, **extra)


def test_no_pipelining_equals_single_process():
    _check_against_reference("llama", 2, 1, None, 3)


def _tp_pp_full_grads(num_microbatches, sequence_parallel):
    config = dict(sequence_parallel=sequence_parallel)
    result = _pipelined("llama", 4, 2, None, num_microbatches, tp=2, **config)
    (stage,) = result["stages"]
    grads = dict(stage["grads"])
    for name in stage["sequence_parallel"]:  # norm weights: partial sums per TP rank
        grads[name] = grads[name].clone()
        dist.all_reduce(grads[name], group=ps.get_tensor_model_parallel_group())
    shards = [None] * 2
    dist.all_gather_object(shards, grads, group=ps.get_tensor_model_parallel_group())
    stage["grads"] = merge_state_dicts(shards, gated_mlp=True)
    return result


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_and_pipeline_parallel_equals_single_process(sequence_parallel):
    ref_losses, ref_grads = run_distributed(_reference, world_size=1, tp=1, kind="llama",
                                            layers=4, num_microbatches=3)[0]
    ranks = run_distributed(_tp_pp_full_grads, world_size=4, tp=2, pp=2, num_microbatches=3,
                            sequence_parallel=sequence_parallel)
    for rank in ranks:
        (stage,) = rank["stages"]
        want = _expected(stage, ref_grads)
        for name, grad in stage["grads"].items():
            err = (grad - want[name]).abs().max().item()
            assert err <= TP_TOL, f"PP {rank['pp_rank']} TP {rank['tp_rank']} {name}: {err:.3g}"
        if rank["pp_rank"] == 1:
            for got, want_loss in zip(rank["losses"], ref_losses):
                assert abs(got.item() - want_loss.item()) <= TP_TOL
