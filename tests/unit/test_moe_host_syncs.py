"""Host syncs of one MoE layer (issue 36), counted on CPU with tests/sync_counter.py.

On CUDA every device-to-host read (bincount, int(t.sum()), .tolist(), repeat_interleave
without output_size) makes the CPU wait for the GPU. One training forward and backward of an
MoE layer (router with expert bias, aux and z losses; the metrics counters) may copy sizes to
the host at most once:
- EP = 1 (LocalDispatcher): none, except one copy of the kept counts when dropping without
  padding (the row count depends on them) or the expert loop's split sizes without a
  capacity; the grouped GEMM reads the counts on the device.
- EP = 2 (both dispatchers): exactly one, the split sizes the all-to-all / all-gather needs,
  which the expert loop reuses.
The numbers these paths compute are checked elsewhere (test_moe_layer.py, test_ep_dispatcher.py,
test_expert_tensor_parallel.py); here: count_per_expert against bincount, and the combine
in fp32 against a float64 reference (bf16 rows) and against the previous expression (fp32).
"""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe import MoEConfig, MoELayer
from megatron.core.transformer.moe.capacity import RowPlan, combine, count_per_expert
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.distributed import run_distributed
from tests.sync_counter import SyncCounter

SEQ, BATCH, HIDDEN, FFN, EXPERTS = 6, 2, 16, 8, 4  # fp32 rows of 64 / 32 bytes: grouped GEMM

PLANS = {  # MoEConfig fields, and the host copies expected at EP = 1: (loop, grouped GEMM)
    "no_capacity": (dict(), (1, 0)),
    "drop": (dict(moe_expert_capacity_factor=0.5), (1, 1)),
    "pad": (dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True),
            (0, 0)),
}


def _layer(ep=1, dispatcher="alltoall", grouped_gemm=False, **moe):
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, activation="swiglu",
        add_bias_linear=False, expert_model_parallel_size=ep,
        moe=MoEConfig(num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                      moe_grouped_gemm=grouped_gemm, moe_token_dispatcher_type=dispatcher,
                      moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.01,
                      moe_z_loss_coeff=0.001, **moe))
    torch.manual_seed(0)
    return MoELayer(config)


def _syncs_of_a_step(layer, seed):
    """The host reads of one training forward and backward of the layer."""
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(seed),
                    requires_grad=True)
    layer.train()
    with SyncCounter() as syncs:
        out, _ = layer(x)
        out.square().sum().backward()
    return syncs.calls


@pytest.mark.parametrize("grouped_gemm", [False, True])
@pytest.mark.parametrize("plan", list(PLANS))
def test_local_layer_copies_sizes_at_most_once(plan, grouped_gemm):
    moe, expected = PLANS[plan]
    calls = _syncs_of_a_step(_layer(grouped_gemm=grouped_gemm, **moe), seed=1)
    assert len(calls) == expected[grouped_gemm], calls


def _ep_syncs(dispatcher, plan, grouped_gemm):
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    try:
        layer = _layer(ep=2, dispatcher=dispatcher, grouped_gemm=grouped_gemm,
                       **PLANS[plan][0])
        return _syncs_of_a_step(layer, seed=10 + ps.get_expert_model_parallel_rank())
    finally:
        ps.destroy_model_parallel()


# The grouped GEMM reads no host sizes at EP = 1 either: its EP cases go to the full suite.
@pytest.mark.parametrize("grouped_gemm", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_layer_copies_split_sizes_once(dispatcher, plan, grouped_gemm):
    results = run_distributed(_ep_syncs, world_size=2, dispatcher=dispatcher, plan=plan,
                              grouped_gemm=grouped_gemm)
    for rank, calls in enumerate(results):
        assert len(calls) == 1 and calls[0].startswith("tolist"), f"rank {rank}: {calls}"


def test_count_per_expert_equals_bincount():
    ids = torch.randint(0, 7, (50, 3), generator=torch.Generator().manual_seed(3))
    ids[ids == 5] = 6  # an expert nobody picks
    for sample in (ids, ids[:0]):
        want = torch.bincount(sample.reshape(-1), minlength=8)
        got = count_per_expert(sample, 8)
        assert got.dtype == want.dtype and torch.equal(got, want)


def _plan(num_rows, num_tokens, seed):
    """Rows of random tokens (many rows per token, so the sums are long) and gate weights."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, num_tokens, (num_rows,), generator=gen)
    probs = torch.rand(num_rows, generator=gen)
    return RowPlan(row_token=tokens, row_probs=probs, row_expert=torch.zeros_like(tokens),
                   tokens_per_expert=torch.tensor([num_rows]), num_tokens=num_tokens,
                   padded=False, num_dropped=torch.tensor(0))


def _previous_combine(rows, plan):
    """The combine before issue 36: products and sums in the rows' dtype."""
    weighted = rows * plan.row_probs.to(rows.dtype).unsqueeze(-1)
    out = rows.new_zeros(plan.num_tokens + 1, rows.shape[1]).index_add(0, plan.row_token,
                                                                       weighted)
    return out[:plan.num_tokens]


def test_combine_of_bf16_rows_accumulates_in_fp32():
    """64 rows per token on average: bf16 sums round at every step, fp32 ones once at the
    end. The fp32 combine is within half a bf16 ulp (at most 2^-8 relative) of the float64
    sum, plus fp32 rounding; the bf16-accumulating one is farther, in total and at the worst
    token."""
    plan = _plan(num_rows=1024, num_tokens=16, seed=4)
    rows = torch.randn(1024, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    want = torch.zeros(16, 32, dtype=torch.float64).index_add(
        0, plan.row_token, rows.double() * plan.row_probs.double().unsqueeze(-1))
    got, before = combine(rows, plan), _previous_combine(rows, plan)
    assert got.dtype == torch.bfloat16
    error, error_before = (got.double() - want).abs(), (before.double() - want).abs()
    assert (error <= want.abs() * 2.0 ** -8 + 1e-5).all()
    assert error.sum() < error_before.sum() and error.max() < error_before.max()


def test_combine_of_fp32_rows_is_unchanged_bitwise():
    plan = _plan(num_rows=300, num_tokens=40, seed=6)
    plan.row_probs.requires_grad_()
    rows = torch.randn(300, 24, generator=torch.Generator().manual_seed(7), requires_grad=True)
    upstream = torch.randn(40, 24, generator=torch.Generator().manual_seed(8))
    got, before = combine(rows, plan), _previous_combine(rows, plan)
    assert torch.equal(got, before)
    grads = torch.autograd.grad((got * upstream).sum(), [rows, plan.row_probs])
    grads_before = torch.autograd.grad((before * upstream).sum(), [rows, plan.row_probs])
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_before))
