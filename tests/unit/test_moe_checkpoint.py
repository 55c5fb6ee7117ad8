"""Checkpoints of MoE models in process (gloo, fp32), both formats, any EP / TP / DP.

A run (EP=2 at world 2, or TP=2 x EP=2 with sequence parallelism at world 4; plain or
distributed optimizer) trains 3 steps, saves, and trains a 4th; another layout (EP=1 in one
process, EP=4 at world 4, TP changed) loads the save. Gathered whole (with tp_sharding's
merge, not the checkpoint code), its weights (every expert, the router and its expert bias,
the dense layer) and Adam's exp_avg / exp_avg_sq equal the saved run's BITWISE: loading only
copies bytes. Its 4th step equals the saved run's: bitwise at the same layout, within
REASSOCIATION_TOL (1e-6) at another (gradients are summed over other groups, in another
order; the experts' sums over tokens are the same, tokens per expert are identical).
"""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ddp_config_for_optimizer,
)
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models import LlamaModel
from megatron.core.models.tp_sharding import merge_state_dicts
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.transformer.moe import MoEConfig
from megatron.training.checkpointing import load_checkpoint
from megatron.training.checkpointing.writer import CheckpointWriter
from megatron.training.training_config import MegatronConfigs, TrainingConfig
from tests.distributed import run_distributed
from tests.unit.test_checkpoint_save import _save, _scheduler
from tests.unit.test_data_parallel import REASSOCIATION_TOL, VOCAB, _config, _global_batches
from tests.unit.test_distributed_optimizer import _optimizer_config, _train

BATCHES = _global_batches(4, steps=4)  # 4 microbatches per step


def _build(tp, ep, kind):
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    moe = MoEConfig(num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                    moe_layer_freq=[1, 0], moe_router_enable_expert_bias=True,
                    moe_aux_loss_coeff=1e-2)
    config = _config(moe=moe, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                     expert_model_parallel_size=ep)
    opt_config = _optimizer_config(kind, clip_grad=1.0)
    ddp_config = DistributedDataParallelConfig() if kind == "none" else \
        ddp_config_for_optimizer(opt_config)
    torch.manual_seed(42)
    model = DistributedDataParallel(config, ddp_config, LlamaModel(config, VOCAB))
    config.finalize_model_grads_func = finalize_model_grads
    return model, get_megatron_optimizer(opt_config, [model]), opt_config


def _coords():
    return (ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank())


def _merge(per_rank):
    """[(coords, {name: local tensor})] of every rank -> whole tensors (tp_sharding's merge:
    dense by TP rank, stacked experts by (EP, expert-TP) rank)."""
    return merge_state_dicts([s for _, s in per_rank], True, [c for c, _ in per_rank])


def _whole_state(model, optimizer):
    """(weights and buffers, {key: {name: tensor}}, step), whole, on every rank."""
    state = {n: t.detach().clone() for n, t in model.module.state_dict().items()}
    named = optimizer.state_dict()
    mine = {}  # what this rank holds whole of the optimizer state (the distributed one
    if named is not None:  # gathers dense state to DP rank 0, experts to expert-DP rank 0)
        for name, entry in named["params"].items():
            for key, value in entry.items():
                mine.setdefault(key, {})[name.split("/", 1)[1]] = value.clone()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (_coords(), state, mine,
                                      None if named is None else named["step"]))
    weights = _merge([(c, s) for c, s, _, _ in gathered])
    keys = sorted({k for _, _, m, _ in gathered for k in m})
    optim = {}
    for key in keys:
        names = set(gathered[0][1]) & {n for _, _, m, _ in gathered for n in m.get(key, {})}
        # one rank per shard holds each entry: fill the others' from it (same coordinates)
        shards = []
        for coords, _, _, _ in gathered:
            entry = {}
            for name in names:
                for c, _, m, _ in gathered:
                    same = c[0] == coords[0] if "experts" not in name else c[1:] == coords[1:]
                    if same and name in m.get(key, {}):
                        entry[name] = m[key][name]
                        break
            shards.append((coords, entry))
        optim[key] = _merge(shards)
    steps = {s for _, _, _, s in gathered if s is not None}
    assert len(steps) == 1, steps
    return weights, optim, steps.pop()


def _configs(model, opt_config, fmt, **training):
    return MegatronConfigs(transformer=model.config, optimizer=opt_config,
                           ddp=model.ddp_config, scheduler_kwargs={}, dataset=None,
                           training=TrainingConfig(ckpt_format=fmt, **training))


def _save_after_3_steps(tmp_path, cut, kind, fmt):
    model, optimizer, opt_config = _build(*cut, kind)
    scheduler = _scheduler(optimizer)
    _train(model, optimizer, BATCHES[:3])
    configs = _configs(model, opt_config, fmt, save=str(tmp_path))
    _save(tmp_path, 3, model, optimizer, scheduler, configs, CheckpointWriter())
    saved = _whole_state(model, optimizer)
    _train(model, optimizer, BATCHES[3:])
    return saved, _whole_state(model, optimizer)[0]


def _load_and_step(tmp_path, cut, kind, fmt):
    model, optimizer, opt_config = _build(*cut, kind)
    configs = _configs(model, opt_config, fmt, load=str(tmp_path))
    loaded = load_checkpoint([model], optimizer, _scheduler(optimizer), configs)
    assert loaded.iteration == 3
    state = _whole_state(model, optimizer)
    _train(model, optimizer, BATCHES[3:])
    return state, _whole_state(model, optimizer)[0]


def _assert_equal(got, want, tol=0.0):
    assert got.keys() == want.keys()
    for name, value in want.items():
        if tol == 0:
            assert torch.equal(got[name], value), name
        else:
            err = (got[name] - value).abs().max().item()
            assert err <= tol, f"{name}: {err:.3g} > {tol}"


def _save_then_load(tmp_path, fmt, saved, loads):
    """``saved`` and each of ``loads``: (world, TP, EP, optimizer kind)."""
    world, tp, ep, kind = saved
    (weights, optim, step), fourth = run_distributed(
        _save_after_3_steps, world_size=world, tmp_path=tmp_path, cut=(tp, ep), kind=kind,
        fmt=fmt)[0]
    assert any(".mlp.experts." in n for n in weights) and optim["exp_avg"]
    for loaded in loads:
        l_world, l_tp, l_ep, l_kind = loaded
        (l_weights, l_optim, l_step), l_fourth = run_distributed(
            _load_and_step, world_size=l_world, tmp_path=tmp_path, cut=(l_tp, l_ep),
            kind=l_kind, fmt=fmt)[0]
        _assert_equal(l_weights, weights)
        assert l_step == step == 3.0
        assert sorted(l_optim) == sorted(optim) == ["exp_avg", "exp_avg_sq"]
        for key in optim:
            _assert_equal(l_optim[key], optim[key])
        _assert_equal(l_fourth, fourth, 0.0 if saved == loaded else REASSOCIATION_TOL)


# (world, TP, EP, optimizer): expert-DP is 1 at (2, 1, 2), (4, 2, 2), (4, 4, 1) and 2 at
# (4, 1, 2) (experts gathered over / written spread over two replicas).
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_ep2_saves_and_loads_at_ep2_ep1_and_ep4(tmp_path, fmt):
    _save_then_load(tmp_path, fmt, (2, 1, 2, "distributed"),
                    [(2, 1, 2, "distributed"), (1, 1, 1, "none"), (4, 1, 4, "none")])


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_tp2_ep2_with_sequence_parallel_loads_at_another_tp_and_ep(tmp_path, fmt):
    _save_then_load(tmp_path, fmt, (4, 2, 2, "none"),
                    [(4, 1, 2, "distributed"), (4, 4, 1, "distributed")])


def test_expert_dp2_distributed_optimizer_saves_and_loads_at_tp2_ep2(tmp_path):
    _save_then_load(tmp_path, "torch", (4, 1, 2, "distributed"), [(4, 2, 2, "none")])
