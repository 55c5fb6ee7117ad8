"""Checkpoints of MoE models in process (gloo, fp32), both formats, any EP / TP / DP / PP.

A run (EP=2 at world 2; TP=2 x EP=2 with sequence parallelism at world 4, expert TP equal
to TP or 1; EP=2 x PP=2; plain or distributed optimizer) trains 3 steps, saves in each format,
and trains a 4th; other layouts (EP=1 in one process, EP=4, TP or expert TP changed,
interleaved virtual stages) load each save. Gathered whole (with tp_sharding's merge and a
layer renumbering written here, not the checkpoint code), the weights (every expert, the
router and its expert bias, the dense layers) and Adam's exp_avg / exp_avg_sq equal the saved
run's BITWISE: loading only copies bytes. Its 4th step equals the saved run's: bitwise at the
same layout, within REASSOCIATION_TOL (1e-6) at another (gradients are summed over other
groups, in another order; the experts' sums over tokens are the same, tokens per expert are
identical).
"""
import re
from typing import NamedTuple, Optional

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
from megatron.core.models import LlamaModel, llama_config
from megatron.core.models.tp_sharding import merge_state_dicts
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import build_model_chunks, get_forward_backward_func
from megatron.core.transformer.moe import MoEConfig
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.checkpointing.writer import CheckpointWriter
from megatron.training.training_config import MegatronConfigs, TrainingConfig
from tests.distributed import run_distributed
from tests.unit.test_checkpoint_save import _scheduler
from tests.unit.test_data_parallel import (
    MBS,
    REASSOCIATION_TOL,
    SEQ,
    VOCAB,
    _forward_step,
    _global_batches,
)
from tests.unit.test_distributed_optimizer import _optimizer_config

BATCHES = _global_batches(4, steps=4)  # 4 microbatches per step
FORMATS = ["torch_dist", "torch"]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


class Cut(NamedTuple):
    """A layout: world size, TP, EP, optimizer kind, expert TP (None: TP), PP, virtual
    stages per rank, layers (2: [MoE, dense]; 4: [MoE, dense, MoE, MoE], so at PP=2 with
    2 virtual stages rank 1's first chunk has no experts), gpt-oss's MoE pieces (biases
    everywhere, the experts' and the router's too, and the clamped quick-GeGLU), and a
    multi-token prediction depth (its layer of the last layer's kind)."""
    world: int
    tp: int
    ep: int
    kind: str
    etp: Optional[int] = None
    pp: int = 1
    vpp: Optional[int] = None
    layers: int = 2
    gpt_oss: bool = False
    mtp: bool = False


def _build(cut):
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(cut.tp, cut.pp, cut.vpp, expert_model_parallel_size=cut.ep,
                                 expert_tensor_parallel_size=cut.etp)
    moe = MoEConfig(num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                    moe_layer_freq=[1, 0, 1, 1] if cut.layers == 4 else [1, 0],
                    moe_router_enable_expert_bias=True, moe_aux_loss_coeff=1e-2,
                    moe_router_bias=cut.gpt_oss)
    gpt_oss = dict(activation="quick_geglu", activation_func_clamp_value=7.0,
                   glu_linear_offset=1.0, add_bias_linear=True) if cut.gpt_oss else {}
    # test_data_parallel's _config sizes, with the layer count of the cut
    config = llama_config(
        num_layers=cut.layers, hidden_size=32, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=48, max_position_embeddings=SEQ, moe=moe,
        tensor_model_parallel_size=cut.tp, sequence_parallel=cut.tp > 1,
        expert_model_parallel_size=cut.ep, expert_tensor_parallel_size=cut.etp,
        pipeline_model_parallel_size=cut.pp, virtual_pipeline_model_parallel_size=cut.vpp,
        mtp_num_layers=1 if cut.mtp else None, mtp_loss_scaling_factor=0.3, **gpt_oss)
    opt_config = _optimizer_config(cut.kind, clip_grad=1.0)
    ddp_config = DistributedDataParallelConfig() if cut.kind == "none" else \
        ddp_config_for_optimizer(opt_config)
    torch.manual_seed(42)
    chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in
              build_model_chunks(lambda **stage: LlamaModel(config, VOCAB, **stage), config)]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, get_megatron_optimizer(opt_config, chunks), opt_config


def _train(chunks, optimizer, batches):
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    for batch in batches:
        local = len(batch) // dp
        mine = batch[rank * local:(rank + 1) * local]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [iter(mine) for _ in chunks]
        get_forward_backward_func()(
            forward_step_func=_forward_step, model=chunks, num_microbatches=local,
            data_iterator=iterators if len(chunks) > 1 else iterators[0], seq_length=SEQ,
            micro_batch_size=MBS)
        assert optimizer.step()[0]


def _coords():
    return (ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank())


def _global(name, chunk):
    """A chunk-local name with its global layer number (renumbered here, not by the
    checkpoint code); the last stage's copy of the (untied) embedding for multi-token
    prediction is the embedding (_merge checks the two are equal)."""
    if name == "mtp.word_embeddings.weight":
        return "embedding.word_embeddings.weight"
    match = _LAYER.match(name)
    offset = chunk.module.decoder.layer_offset
    return f"decoder.layers.{int(match[1]) + offset}.{match[2]}" if match else name


def _merge(per_rank):
    """[(coords, pp rank, {global name: local tensor})] of every rank -> whole tensors
    (tp_sharding's merge per stage: dense by TP rank, stacked experts by (EP, expert-TP))."""
    out = {}
    for stage in sorted({pp for _, pp, _ in per_rank}):
        mine = [(c, s) for c, pp, s in per_rank if pp == stage]
        for name, tensor in merge_state_dicts([s for _, s in mine], True,
                                              [c for c, _ in mine]).items():
            assert name not in out or torch.equal(out[name], tensor), name  # a copy
            out[name] = tensor
    return out


def _whole_state(chunks, optimizer):
    """(weights and buffers, {key: {name: tensor}}, step), whole, on every rank."""
    state = {_global(n, c): t.detach().clone()
             for c in chunks for n, t in c.module.state_dict().items()}
    named = optimizer.state_dict()
    mine = {}  # what this rank holds whole of the optimizer state (the distributed one
    if named is not None:  # gathers dense state to DP rank 0, experts to expert-DP rank 0)
        for name, entry in named["params"].items():
            c, local = name.split("/", 1)
            for key, value in entry.items():
                mine.setdefault(key, {})[_global(local, chunks[int(c)])] = value.clone()
    gathered = [None] * dist.get_world_size()
    pp = ps.get_pipeline_model_parallel_rank()
    dist.all_gather_object(gathered, (_coords(), pp, state, mine,
                                      None if named is None else named["step"]))
    weights = _merge([(c, p, s) for c, p, s, _, _ in gathered])
    keys = sorted({k for _, _, _, m, _ in gathered for k in m})
    optim = {}
    for key in keys:
        held = {n for _, _, _, m, _ in gathered for n in m.get(key, {})}
        # one rank per shard holds each entry: fill the others' from it (same coordinates)
        shards = []
        for coords, pp, weights_of, _, _ in gathered:
            entry = {}
            for name in set(weights_of) & held:
                for c, p, _, m, _ in gathered:
                    same = c[0] == coords[0] if "experts" not in name else c[1:] == coords[1:]
                    if same and p == pp and name in m.get(key, {}):
                        entry[name] = m[key][name]
                        break
            shards.append((coords, pp, entry))
        optim[key] = _merge(shards)
    steps = {s for _, _, _, _, s in gathered if s is not None}
    assert len(steps) == 1, steps
    return weights, optim, steps.pop()


def _configs(chunks, opt_config, fmt, **training):
    return MegatronConfigs(transformer=chunks[0].config, optimizer=opt_config,
                           ddp=chunks[0].ddp_config, scheduler_kwargs={}, dataset=None,
                           training=TrainingConfig(ckpt_format=fmt, **training))


def _save_after_3_steps(tmp_path, cut, fmts):
    """One run saved in each format (tmp_path/fmt), then its 4th step."""
    chunks, optimizer, opt_config = _build(cut)
    scheduler = _scheduler(optimizer)
    _train(chunks, optimizer, BATCHES[:3])
    for fmt in fmts:
        root = str(tmp_path / fmt)
        save_checkpoint(root, 3, chunks, optimizer, scheduler,
                        _configs(chunks, opt_config, fmt, save=root), {}, 3, 0,
                        CheckpointWriter())
    saved = _whole_state(chunks, optimizer)
    _train(chunks, optimizer, BATCHES[3:])
    return saved, _whole_state(chunks, optimizer)[0]


def _load_and_step(tmp_path, cut, fmts):
    """{fmt: (loaded whole state, weights after the 4th step)}, a fresh model per format."""
    out = {}
    for fmt in fmts:
        chunks, optimizer, opt_config = _build(cut)
        assert len(chunks) == (cut.vpp or 1)
        configs = _configs(chunks, opt_config, fmt, load=str(tmp_path / fmt))
        loaded = load_checkpoint(chunks, optimizer, _scheduler(optimizer), configs)
        assert loaded.iteration == 3
        state = _whole_state(chunks, optimizer)
        _train(chunks, optimizer, BATCHES[3:])
        out[fmt] = state, _whole_state(chunks, optimizer)[0]
    return out


def _assert_equal(got, want, tol=0.0):
    assert got.keys() == want.keys()
    for name, value in want.items():
        if tol == 0:
            assert torch.equal(got[name], value), name
        else:
            err = (got[name] - value).abs().max().item()
            assert err <= tol, f"{name}: {err:.3g} > {tol}"


def _save_then_load(tmp_path, saved, loads, fmts=FORMATS):
    """``saved`` and each of ``loads``: a Cut; every load reads the save in each format."""
    (weights, optim, step), fourth = run_distributed(
        _save_after_3_steps, world_size=saved.world, tmp_path=tmp_path, cut=saved,
        fmts=fmts)[0]
    assert any(".mlp.experts." in n for n in weights) and optim["exp_avg"]
    if saved.gpt_oss:  # trained away from their zero init, so a load that missed them fails
        for name in ("mlp.experts.bias1", "mlp.experts.bias2", "mlp.router.bias"):
            assert weights[f"decoder.layers.0.{name}"].abs().sum() > 0, name
    for loaded in loads:
        by_format = run_distributed(_load_and_step, world_size=loaded.world,
                                    tmp_path=tmp_path, cut=loaded, fmts=fmts)[0]
        for fmt, ((l_weights, l_optim, l_step), l_fourth) in by_format.items():
            _assert_equal(l_weights, weights)
            assert l_step == step == 3.0, fmt
            assert sorted(l_optim) == sorted(optim) == ["exp_avg", "exp_avg_sq"]
            for key in optim:
                _assert_equal(l_optim[key], optim[key])
            _assert_equal(l_fourth, fourth, 0.0 if saved == loaded else REASSOCIATION_TOL)
    return weights


# Expert-DP is 1 at (world 2, EP 2), (4, TP 2, EP 2), (4, TP 4, EP 1) and 2 at (4, TP 1, EP 2)
# (experts gathered over / written spread over two replicas).
# gpt-oss: biased experts (bias1/bias2 per global expert, like the weights) and router bias,
# loaded at EP=1 only (the same cut rules as the weights, which the other layouts check).
@pytest.mark.parametrize("gpt_oss,loads", [
    (False, [Cut(2, 1, 2, "distributed"), Cut(1, 1, 1, "none"), Cut(4, 1, 4, "none")]),
    (True, [Cut(1, 1, 1, "none", gpt_oss=True)])], ids=["swiglu", "gpt_oss"])
def test_ep2_saves_and_loads_at_ep2_ep1_and_ep4(tmp_path, gpt_oss, loads):
    _save_then_load(tmp_path, Cut(2, 1, 2, "distributed", gpt_oss=gpt_oss), loads)


def test_tp2_ep2_with_sequence_parallel_loads_at_another_tp_and_ep(tmp_path):
    _save_then_load(tmp_path, Cut(4, 2, 2, "none"),
                    [Cut(4, 1, 2, "distributed"), Cut(4, 4, 1, "distributed")])


def test_expert_dp2_distributed_optimizer_saves_and_loads_at_tp2_ep2(tmp_path):
    _save_then_load(tmp_path, Cut(4, 1, 2, "distributed"), [Cut(4, 2, 2, "none")], ["torch"])


# EP=2 x PP=2 (DP=2, expert-DP 1) -> one process, and -> interleaved PP=2 (2 chunks per rank:
# layers 0 and 2 on rank 0, 1 and 3 on rank 1) x EP=2, same as saved but for the chunks.
def test_ep2_pp2_loads_at_pp1_ep1_and_interleaved_pp2_ep2(tmp_path):
    _save_then_load(tmp_path, Cut(4, 1, 2, "distributed", pp=2, layers=4),
                    [Cut(1, 1, 1, "none", layers=4),
                     Cut(4, 1, 2, "distributed", pp=2, vpp=2, layers=4)])


# Multi-token prediction with experts in its layer (the last layer's kind; LlamaModel: untied
# embeddings, so at PP=2 the last stage holds MTP's copy of the embedding, which checkpoints
# hold as the embedding): EP=2 x PP=2 -> one process and -> interleaved PP=2 x EP=2, and
# EP=2 at PP=1 -> EP=2 x PP=2.
@pytest.mark.parametrize("saved,loads", [
    (Cut(4, 1, 2, "distributed", pp=2, layers=4, mtp=True),
     [Cut(1, 1, 1, "none", layers=4, mtp=True),
      Cut(4, 1, 2, "distributed", pp=2, vpp=2, layers=4, mtp=True)]),
    (Cut(2, 1, 2, "distributed", layers=4, mtp=True),
     [Cut(4, 1, 2, "none", pp=2, layers=4, mtp=True)])],
    ids=["pp2-ep2-to-one-process-and-interleaved", "ep2-to-pp2-ep2"])
def test_mtp_with_experts_and_untied_embeddings_reshards(tmp_path, saved, loads):
    weights = _save_then_load(tmp_path, saved, loads)
    assert weights["mtp.depths.0.layer.mlp.experts.weight1"].shape[0] == 4  # every expert
    assert "mtp.word_embeddings.weight" not in weights


# Expert TP differs from TP: TP=2 (SP) x expert-TP 1 x EP=2 (expert-DP 2) -> TP=1 x expert-TP
# 2 x EP=2 (expert-DP 1): the experts' shards are cut anew, the dense ones merged.
def test_tp2_etp1_ep2_loads_at_tp1_etp2_ep2(tmp_path):
    _save_then_load(tmp_path, Cut(4, 2, 2, "none", etp=1),
                    [Cut(4, 1, 2, "distributed", etp=2)])
