"""Each tensor-parallel layer issues exactly the collectives Megatron's design implies,
in forward and in backward; with one TP rank, none."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from megatron.core.utils import init_method_normal
from tests.collective_counter import count_collectives
from tests.distributed import run_distributed

S, B, H, F = 8, 2, 8, 16
INIT = init_method_normal(0.02)

# name -> (expected forward, expected backward) collectives at TP > 1.
EXPECTED = {
    "column": ({}, {"all_reduce": 1}),
    "column_gather_output": ({"all_gather": 1}, {"all_reduce": 1}),
    # SP: gather the sequence in forward; in backward re-gather it for the weight gradient
    # (only the shard was kept) and reduce-scatter the input gradient.
    "column_sequence_parallel": ({"all_gather": 1}, {"all_gather": 1, "reduce_scatter": 1}),
    "row": ({"all_reduce": 1}, {}),
    "row_scatter_input": ({"all_reduce": 1}, {"all_gather": 1}),
    "row_sequence_parallel": ({"reduce_scatter": 1}, {"all_gather": 1}),
    "embedding": ({"all_reduce": 1}, {}),
    "embedding_reduce_scatter": ({"reduce_scatter": 1}, {"all_gather": 1}),
    # One MAX all-reduce, then target logit + sum of exp (+ sum of logits) packed in one.
    "cross_entropy": ({"all_reduce": 2}, {}),
    "cross_entropy_label_smoothing": ({"all_reduce": 2}, {}),
}


def _build_and_inputs(case):
    tp = ps.get_tensor_model_parallel_world_size()
    sp = ModelParallelConfig(sequence_parallel=True)
    plain = ModelParallelConfig()
    x_full = torch.randn(S, B, H)
    if case.startswith("column"):
        layer = ColumnParallelLinear(H, F, config=sp if "sequence" in case else plain,
                                     init_method=INIT, gather_output="gather" in case)
        x = x_full[: S // tp] if "sequence" in case else x_full
        return lambda inp: layer(inp)[0], x.clone().requires_grad_()
    if case.startswith("row"):
        layer = RowParallelLinear(F, H, config=sp if "sequence" in case else plain,
                                  init_method=INIT, input_is_parallel="scatter" not in case)
        x = torch.randn(S, B, F if "scatter" in case else F // tp)
        return lambda inp: layer(inp)[0], x.requires_grad_()
    if case.startswith("embedding"):
        layer = VocabParallelEmbedding(16, H, config=plain, init_method=INIT,
                                       reduce_scatter_embeddings="reduce_scatter" in case)
        return layer, torch.randint(0, 16, (B, S))
    smoothing = 0.1 if "smoothing" in case else 0.0
    target = torch.randint(0, 16, (S, B))
    return (lambda inp: vocab_parallel_cross_entropy(inp, target, smoothing),
            torch.randn(S, B, 16 // tp).requires_grad_())


def _count(case):
    fn, x = _build_and_inputs(case)
    with count_collectives() as forward:
        y = fn(x)
    with count_collectives() as backward:
        y.sum().backward()
    return dict(forward), dict(backward)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_collectives_per_layer_at_tp2(case):
    got = run_distributed(_count, world_size=2, tp=2, case=case)
    assert got == [EXPECTED[case]] * 2


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_no_collectives_at_tp1(case):
    assert run_distributed(_count, world_size=1, tp=1, case=case) == [({}, {})]
