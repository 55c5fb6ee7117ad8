"""An MoE LLaMA under context parallelism equals one process: one training step through the
schedule (the aux-loss gradient's scale), DDP and finalize_model_grads (the expert-bias counts
over TP x CP x DP), on the same global batch of DP micro batches.

Each CP rank routes its own chunks; the router's token counts, the per-sequence aux loss and the
z-loss sum over CP (TP x CP under sequence parallelism), so the reported lm loss of each micro
batch, the logged aux and z losses, every gathered gradient and the moved expert biases match
one process. Cases: CP 2 (the experts reduced over DP x CP), CP 2 x EP 2 x DP 2 (expert-DP
over DP), and TP 2 (SP) x CP 2 x EP 2 with expert TP 1 (the TP x CP group). Tolerance 1e-5
relative to the largest entry: the sums over ranks re-associate fp32 adds."""
import functools
from unittest import mock

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models import LlamaModel
from megatron.core.models.llama import llama_config
from megatron.core.models.tp_sharding import merge_state_dicts
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe import router as router_module
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe.router import update_expert_bias
from megatron.training import gpt_step
from megatron.training.data.batch import shard_for_context_parallel
from megatron.training.logging.moe_metrics import gather_moe_metrics
from megatron.training.training import build_model
from tests.distributed import run_distributed

VOCAB, SEQ, MBS, EXPERTS, LAYERS = 64, 32, 2, 4, 2
TOL = 1e-5


def _config(tp, cp, ep, balancing):
    # DeepSeek-V3's routing in small: sigmoid, groups, correction bias, scaling.
    moe = MoEConfig(num_moe_experts=EXPERTS, moe_ffn_hidden_size=16, moe_router_topk=2,
                    moe_router_score_function="sigmoid", moe_router_topk_norm=True,
                    moe_router_num_groups=2, moe_router_group_topk=1,
                    moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.01,
                    moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=0.01,
                    moe_z_loss_coeff=0.001, moe_shared_expert_intermediate_size=24)
    return llama_config(num_layers=LAYERS, hidden_size=32, num_attention_heads=8,
                        num_query_groups=4, ffn_hidden_size=48, max_position_embeddings=SEQ,
                        tensor_model_parallel_size=tp, context_parallel_size=cp,
                        sequence_parallel=tp > 1, expert_model_parallel_size=ep,
                        expert_tensor_parallel_size=1, moe=moe)


def _micro_batches(count):
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(count):
        text = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        loss_mask = (torch.rand(MBS, SEQ, generator=g) > 0.2).float()
        positions = torch.arange(SEQ).expand(MBS, SEQ).contiguous()
        batches.append((text[:, :-1].contiguous(), text[:, 1:].contiguous(), loss_mask,
                        positions))
    return batches


def _forward_step(data_iterator, model):
    tokens, labels, loss_mask, positions = shard_for_context_parallel(*next(data_iterator))
    output = model(tokens, position_ids=positions, labels=labels)
    return output, functools.partial(gpt_step.loss_func, loss_mask)


def _step(ep, balancing, micro_batches):
    """One step on this rank's micro batches (DP rank d takes the d-th); returns what the
    comparison needs and where this rank sits."""
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    ps.initialize_expert_parallel(ep, 1)
    config = _config(tp, cp, ep, balancing)
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                        DistributedDataParallelConfig(), seed=42)[0]
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = micro_batches // dp
    mine = _micro_batches(micro_batches)[dp_rank * local:(dp_rank + 1) * local]
    counts = []  # each router's summed token counts, as the expert-bias update sees them

    def recording_update(bias, tokens_per_expert, rate):
        counts.append(tokens_per_expert.clone())
        return update_expert_bias(bias, tokens_per_expert, rate)

    with mock.patch.object(router_module, "update_expert_bias", recording_update):
        store = get_forward_backward_func()(forward_step_func=_forward_step,
                                            data_iterator=iter(mine), model=[model],
                                            num_microbatches=local, seq_length=SEQ,
                                            micro_batch_size=MBS)
    metrics = gather_moe_metrics([model], LAYERS, EXPERTS, tp * cp)
    grads = {name: p.main_grad.detach().clone() for name, p in model.module.named_parameters()}
    biases = {name: b.detach().clone() for name, b in model.module.named_buffers()
              if name.endswith("expert_bias")}
    where = dict(tp=ps.get_tensor_model_parallel_rank(), cp=ps.get_context_parallel_rank(),
                 dp=dp_rank, ep=ps.get_expert_model_parallel_rank())
    return dict(losses=[float(s["lm loss"]) for s in store], metrics=metrics, grads=grads,
                biases=biases, counts=counts, where=where)


def _close(got, want, what):
    scale = want.abs().max().item()
    assert scale > 0, what
    err = (got - want).abs().max().item()
    assert err <= TOL * scale, (what, err, scale)


# (world, TP, CP, EP, balancing): DP = world / (TP x CP)
CASES = {"cp2": (2, 1, 2, 1, "aux_loss"), "cp2-ep2-dp2": (4, 1, 2, 2, "seq_aux_loss"),
         "tp2-cp2-ep2": (4, 2, 2, 2, "aux_loss")}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_under_context_parallelism_equals_one_process(case):
    world, tp, cp, ep, balancing = CASES[case]
    dp = world // (tp * cp)
    want = run_distributed(_step, world_size=1, tp=1, ep=1, balancing=balancing,
                           micro_batches=dp)[0]
    results = run_distributed(_step, world_size=world, tp=tp, cp=cp, ep=ep,
                              balancing=balancing, micro_batches=dp)
    assert len(want["losses"]) == dp
    for r in results:
        assert r["losses"] == pytest.approx([want["losses"][r["where"]["dp"]]], rel=TOL)
        assert r["metrics"].keys() == want["metrics"].keys()
        for key in ("load balancing loss", "z loss"):
            assert r["metrics"][key] == pytest.approx(want["metrics"][key], rel=TOL), key
        assert len(r["counts"]) == LAYERS and all(torch.equal(got, counted) for got, counted
                                                  in zip(r["counts"], want["counts"]))
        assert r["biases"].keys() == want["biases"].keys() and want["biases"]
        for name, bias in r["biases"].items():
            assert torch.equal(bias, want["biases"][name]), name
    # Gradients are reduced over DP x CP (experts over expert-DP): the dense shards come from
    # the first rank of each TP rank, the experts from the first of each EP rank.
    coords = [(r["where"]["tp"], r["where"]["ep"], 0) for r in results]
    grads = merge_state_dicts([r["grads"] for r in results], gated_mlp=True, ranks=coords)
    assert grads.keys() == want["grads"].keys()
    for name, grad in grads.items():
        _close(grad, want["grads"][name], (case, name))
    # ... and every other rank holds the same as the one merged.
    for r in results:
        for name, grad in r["grads"].items():
            key = "ep" if ".mlp.experts." in name else "tp"
            first = next(o for o in results if o["where"][key] == r["where"][key])
            _close(grad, first["grads"][name], (case, r["where"], name))
