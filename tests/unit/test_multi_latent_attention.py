"""Multi-latent attention (DeepSeek-V3's MLA, multi_latent_attention.py), fp32 on CPU.

- One layer against Hugging Face's DeepseekV3Attention given the same weights: the output and
  the gradients of the input and of every weight within 1e-5 (of each tensor's largest
  entry where that exceeds 1), with and without the query
  latent (q_lora_rank), RoPE on halves and on interleaved pairs, plain and YaRN with
  DeepSeek's mscale_all_dim (whose softmax factor matters: without it the output is off by
  far more than the tolerance); packed documents against HF given the block-diagonal mask.
- TP=2 with and without sequence parallelism, CP=2 (ring and all-gather, with and without
  packed documents) against one process: outputs, input gradients and every weight's
  gradient (sharded ones merged with tp_sharding's dims, replicated ones summed over TP as
  finalize_model_grads does, over CP as DDP's reduction does), within 1e-5.
- A whole LlamaModel with MLA: full and selective recomputation give the same loss and
  gradients; its parameters are the memory estimate's, name by name; a checkpoint saved at
  TP=2 (sequence parallel) loads at TP=1, in both formats, weights bitwise.
"""
import math

import pytest
import torch

from megatron.core.models.tp_sharding import merge_tensor, partition_of, shard_tensor
from tests.distributed import run_distributed

TOL = 1e-5
B, S, HIDDEN, HEADS = 2, 16, 32, 4
SIZES = dict(kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
# rotary_scaling_factor 40 over an original context of 4: positions up to 16 stretch it, and
# mscale 0.9 vs mscale_all_dim 1.0 makes YaRN's cos/sin factor differ from 1 too.
YARN = dict(rope_type="yarn", rotary_scaling_factor=40.0, original_max_position_embeddings=4,
            beta_fast=32.0, beta_slow=1.0, mscale=0.9, mscale_all_dim=1.0)
# our parameter name -> Hugging Face's
HF_NAMES = {"linear_q_proj.weight": "q_proj.weight",
            "linear_q_down_proj.weight": "q_a_proj.weight",
            "q_layernorm.weight": "q_a_layernorm.weight",
            "linear_q_up_proj.weight": "q_b_proj.weight",
            "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
            "kv_layernorm.weight": "kv_a_layernorm.weight",
            "linear_kv_up_proj.weight": "kv_b_proj.weight",
            "linear_proj.weight": "o_proj.weight"}


def _config(q_lora_rank=12, yarn=False, interleaved=True, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{**dict(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, multi_latent_attention=True,
        q_lora_rank=q_lora_rank, rotary_interleaved=interleaved, qk_layernorm=True,
        normalization="RMSNorm", layernorm_epsilon=1e-6, position_embedding_type="rope",
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        max_position_embeddings=S, **SIZES, **(YARN if yarn else {})), **extra})


def _hf_attention(config):
    """DeepseekV3Attention and its rotary embedding for ``config`` (eager attention)."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    max_positions = S
    if config.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": config.rotary_base,
                "factor": config.rotary_scaling_factor, "mscale": config.mscale,
                "mscale_all_dim": config.mscale_all_dim, "beta_fast": config.beta_fast,
                "beta_slow": config.beta_slow,
                "original_max_position_embeddings": config.original_max_position_embeddings}
        max_positions = int(config.rotary_scaling_factor * config.original_max_position_embeddings)
    hf_config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_head_dim, qk_rope_head_dim=config.qk_pos_emb_head_dim,
        v_head_dim=config.v_head_dim, rope_interleave=config.rotary_interleaved,
        attention_bias=False, attention_dropout=0.0, rope_parameters=rope,
        max_position_embeddings=max_positions)
    hf_config._attn_implementation = "eager"
    return DeepseekV3Attention(hf_config, 0), DeepseekV3RotaryEmbedding(hf_config)


def _weights(config, seed=0):
    """Random full weights by our names (norm weights around 1)."""
    hf, _ = _hf_attention(config)
    gen = torch.Generator().manual_seed(seed)
    ours = {name: hf_name for name, hf_name in HF_NAMES.items()}
    shapes = dict(hf.named_parameters())
    return {name: torch.randn(shapes[hf_name].shape, generator=gen) * 0.3 +
            (1.0 if "layernorm" in name else 0.0)
            for name, hf_name in ours.items() if hf_name in shapes}


def _inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, HIDDEN, generator=gen), torch.randn(S, B, HIDDEN, generator=gen)


def _documents():
    """[b, s] document numbers: sample 0 in three documents, sample 1 in two."""
    ids = torch.zeros(B, S, dtype=torch.long)
    ids[0, 5:], ids[0, 11:], ids[1, 9:] = 1, 2, 1
    return ids


def _packed_params(ids):
    from megatron.core.packed_seq_params import PackedSeqParams

    seqlens = tuple(int(n) for row in ids for n in torch.bincount(row) if n > 0)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(cu, max(seqlens), seqlens, ids)


def _hf_run(config, weights, hidden, dout, documents=None, softmax_scale=None):
    """HF's output [s, b, h] and the gradients of the input and of each weight (our names)."""
    hf, rotary = _hf_attention(config)
    names = {hf_name: name for name, hf_name in HF_NAMES.items()}
    with torch.no_grad():
        for hf_name, p in hf.named_parameters():
            p.copy_(weights[names[hf_name]])
    if softmax_scale is not None:
        hf.scaling = softmax_scale
    x = hidden.transpose(0, 1).clone().requires_grad_()
    positions = torch.arange(S)[None]
    cos, sin = rotary(x, positions)
    visible = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    if documents is not None:
        visible = visible & (documents[:, :, None] == documents[:, None, :])[:, None]
    mask = torch.zeros(visible.shape).masked_fill(~visible, -math.inf)
    out, _ = hf(x, (cos, sin), mask)
    out.backward(dout.transpose(0, 1))
    grads = {names[n]: p.grad for n, p in hf.named_parameters()}
    return out.detach().transpose(0, 1), x.grad.transpose(0, 1), grads


def _our_layer(config, weights):
    """This rank's MLA layer with its TP share of ``weights``."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    layer = MultiLatentAttention(config, 1)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            part = partition_of(f"decoder.layers.0.self_attention.{name}", gated_mlp=False)
            full = weights[name]
            p.copy_(full if part is None else shard_tensor(full, *part, tp, rank))
    return layer


def _sum_replicated_grads_over_tp(layer):
    from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads

    allreduce_sequence_parallel_grads([layer])


def _run_ours(config, weights, hidden, dout, documents=None):
    """One process, or this rank's share of TP / CP: (output, input grad, weight grads) of
    this rank (sequence-sharded where the layout shards it)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.context_parallel import load_balanced_positions, shard_sequence
    from megatron.core.transformer.rope import RotaryEmbedding

    layer = _our_layer(config, weights)
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    positions = load_balanced_positions(S, cp, cp_rank) if cp > 1 else torch.arange(S)
    hidden, dout = (shard_sequence(t, 0, cp, cp_rank) for t in (hidden, dout))
    if config.sequence_parallel:
        hidden = hidden.chunk(tp)[tp_rank]
    hidden = hidden.clone().requires_grad_()
    cos, sin = RotaryEmbedding(config)(positions[None])
    packed = None if documents is None else _packed_params(documents)
    out, bias = layer(hidden, None, cos, sin, packed)
    assert bias is None
    if config.sequence_parallel:
        dout = dout.chunk(tp)[tp_rank]
    out.backward(dout)
    _sum_replicated_grads_over_tp(layer)
    return out.detach(), hidden.grad, {n: p.grad for n, p in layer.named_parameters()}


def _assert_close(got, want, what):
    """Within TOL of the largest entry's magnitude (at least 1): some weight gradients are
    sums over every token and head, tens in size, whose fp32 roundings reach 1e-5."""
    err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert err <= TOL, f"{what}: {err:.3g} > {TOL}"


def _assert_all_close(got, want):
    out, dx, grads = got
    w_out, w_dx, w_grads = want
    _assert_close(out, w_out, "output")
    _assert_close(dx, w_dx, "input gradient")
    assert grads.keys() == w_grads.keys()
    for name in w_grads:
        _assert_close(grads[name], w_grads[name], name)


def _ours_one_process(config_kwargs, weights, documents=None):
    hidden, dout = _inputs()
    return _run_ours(_config(**config_kwargs), weights, hidden, dout, documents)


# --- (a) against Hugging Face ------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["q_latent", "q_proj"])
def test_equals_hf_deepseek_v3_attention(q_lora_rank, yarn, interleaved):
    kwargs = dict(q_lora_rank=q_lora_rank, yarn=yarn, interleaved=interleaved)
    config = _config(**kwargs)
    weights = _weights(config)
    (ours,) = run_distributed(_ours_one_process, world_size=1, tp=1, config_kwargs=kwargs,
                              weights=weights)
    hidden, dout = _inputs()
    _assert_all_close(ours, _hf_run(config, weights, hidden, dout))
    if yarn:  # the softmax factor matters: HF without it is far from ours
        plain = _hf_run(config, weights, hidden, dout,
                        softmax_scale=(config.qk_head_dim + config.qk_pos_emb_head_dim) ** -0.5)
        assert (plain[0] - ours[0]).abs().max() > 100 * TOL


def test_packed_documents_equal_hf_with_the_block_diagonal_mask():
    config = _config()
    weights = _weights(config)
    (ours,) = run_distributed(_ours_one_process, world_size=1, tp=1, config_kwargs={},
                              weights=weights, documents=_documents())
    hidden, dout = _inputs()
    _assert_all_close(ours, _hf_run(config, weights, hidden, dout, _documents()))
    whole = _hf_run(config, weights, hidden, dout)
    assert (whole[0] - ours[0]).abs().max() > 100 * TOL  # the documents mattered


# --- (b), (c) TP and CP against one process ---------------------------------------------------

def _ours_parallel(config_kwargs, weights, documents=None):
    hidden, dout = _inputs()
    return _run_ours(_config(**config_kwargs), weights, hidden, dout, documents)


def _merged(results, config, layout):
    """One process's view of the per-rank results: outputs and input gradients joined
    along the sequence, weight gradients merged over TP (or summed over CP)."""
    from megatron.core.transformer.context_parallel import unshard_sequence

    outs, dxs, grads = zip(*results)
    if layout == "cp":
        joined = [unshard_sequence(list(t), 0) for t in (outs, dxs)]
        return (*joined, {n: sum(g[n] for g in grads) for n in grads[0]})
    if config.sequence_parallel:
        out, dx = torch.cat(outs), torch.cat(dxs)
    else:
        assert all(torch.equal(o, outs[0]) and torch.equal(d, dxs[0])
                   for o, d in zip(outs, dxs))
        out, dx = outs[0], dxs[0]
    merged = {}
    for name in grads[0]:
        part = partition_of(f"decoder.layers.0.self_attention.{name}", gated_mlp=False)
        shards = [g[name] for g in grads]
        if part is None:  # replicated: every rank holds the same (summed) gradient
            assert all(torch.equal(s, shards[0]) for s in shards), name
            merged[name] = shards[0]
        else:
            merged[name] = merge_tensor(shards, *part)
    return out, dx, merged


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["q_latent", "q_proj"])
def test_tensor_parallel_equals_one_process(q_lora_rank, sequence_parallel):
    base = dict(q_lora_rank=q_lora_rank, yarn=True)
    weights = _weights(_config(**base))
    (want,) = run_distributed(_ours_one_process, world_size=1, tp=1, config_kwargs=base,
                              weights=weights)
    kwargs = dict(base, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    results = run_distributed(_ours_parallel, world_size=2, tp=2, config_kwargs=kwargs,
                              weights=weights)
    _assert_all_close(_merged(results, _config(**kwargs), "tp"), want)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_context_parallel_equals_one_process(comm_type, packed):
    documents = _documents() if packed else None
    weights = _weights(_config())
    (want,) = run_distributed(_ours_one_process, world_size=1, tp=1, config_kwargs={},
                              weights=weights, documents=documents)
    kwargs = dict(context_parallel_size=2, cp_comm_type=comm_type)
    results = run_distributed(_ours_parallel, world_size=2, cp=2, config_kwargs=kwargs,
                              weights=weights, documents=documents)
    _assert_all_close(_merged(results, _config(**kwargs), "cp"), want)


# --- a whole model: recomputation, the memory estimate's parameters, checkpoints -----------------

def _model_config(**extra):
    from megatron.core.models import llama_config

    return llama_config(**{**dict(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=48,
        max_position_embeddings=S, multi_latent_attention=True, q_lora_rank=12,
        qk_layernorm=True, rotary_interleaved=True, **SIZES), **extra})


def _loss_and_grads(model, tokens):
    from megatron.core.tensor_parallel import model_parallel_manual_seed

    model.zero_grad()
    model_parallel_manual_seed(5)  # the same dropout masks every run
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _recomputed_runs():
    """(loss, grads) without recomputation, with full (uniform, 1 layer) and selective, with
    attention dropout (so selective recomputes: SDPA's math kernel runs on the CPU)."""
    from megatron.core.models import LlamaModel
    from megatron.core.tensor_parallel import model_parallel_manual_seed

    config = _model_config(attention_dropout=0.1, hidden_dropout=0.1)
    model_parallel_manual_seed(3)
    model = LlamaModel(config, 64)
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(2))
    runs = [_loss_and_grads(model, tokens)]
    for granularity, method, layers in (("full", "uniform", 1), ("selective", None, None)):
        config.recompute_granularity, config.recompute_method = granularity, method
        config.recompute_num_layers = layers
        runs.append(_loss_and_grads(model, tokens))
    return runs


def test_full_and_selective_recomputation_give_the_same_loss_and_gradients():
    plain, *recomputed = run_distributed(_recomputed_runs, world_size=1, tp=1)[0]
    for loss, grads in recomputed:
        assert torch.equal(loss, plain[0])
        for name, grad in plain[1].items():
            assert torch.equal(grads[name], grad), name


def _parameter_names_and_sizes(q_lora_rank, qk_layernorm, normalization):
    from megatron.core import parallel_state as ps
    from megatron.core.models import LlamaModel
    from megatron.training.memory.params import chunk_param_shapes

    config = _model_config(q_lora_rank=q_lora_rank, qk_layernorm=qk_layernorm,
                           normalization=normalization, add_bias_linear=True,
                           tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    model = LlamaModel(config, 64)
    real = [(name, p.numel()) for name, p in model.named_parameters()]
    estimated = [(s.name, s.numel) for s in chunk_param_shapes(
        config, 64, 0, 0, share_embeddings_and_output_weights=False)]
    return real, estimated


@pytest.mark.parametrize("q_lora_rank,qk_layernorm,normalization", [
    (12, True, "RMSNorm"), (None, True, "LayerNorm"), (12, False, "RMSNorm")])
def test_the_memory_estimate_lists_every_parameter_in_order(q_lora_rank, qk_layernorm,
                                                            normalization):
    """memory/params.py's list is the model's, name by name in registration order (DDP's
    buckets follow it), at TP 2."""
    for real, estimated in run_distributed(_parameter_names_and_sizes, world_size=2, tp=2,
                                           q_lora_rank=q_lora_rank, qk_layernorm=qk_layernorm,
                                           normalization=normalization):
        assert estimated == real


def _build_for_checkpoint(tp):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models import LlamaModel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import build_model_chunks
    from tests.unit.test_distributed_optimizer import _optimizer_config

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, expert_model_parallel_size=1)
    config = _model_config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    opt_config = _optimizer_config("none", clip_grad=1.0)
    torch.manual_seed(42)
    chunks = [DistributedDataParallel(config, DistributedDataParallelConfig(), chunk) for chunk
              in build_model_chunks(lambda **stage: LlamaModel(config, 64, **stage), config)]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, get_megatron_optimizer(opt_config, chunks), opt_config


def _save_at_tp2(tmp_path, fmts):
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.checkpointing.writer import CheckpointWriter
    from tests.unit.test_checkpoint_save import _scheduler
    from tests.unit.test_moe_checkpoint import BATCHES, _configs, _train, _whole_state

    chunks, optimizer, opt_config = _build_for_checkpoint(2)
    _train(chunks, optimizer, BATCHES[:2])  # away from the initial weights
    for fmt in fmts:
        root = str(tmp_path / fmt)
        save_checkpoint(root, 2, chunks, optimizer, _scheduler(optimizer),
                        _configs(chunks, opt_config, fmt, save=root), {}, 2, 0,
                        CheckpointWriter())
    return _whole_state(chunks, optimizer)


def _load_at_tp1(tmp_path, fmts):
    from megatron.training.checkpointing import load_checkpoint
    from tests.unit.test_checkpoint_save import _scheduler
    from tests.unit.test_moe_checkpoint import _configs, _whole_state

    out = {}
    for fmt in fmts:
        chunks, optimizer, opt_config = _build_for_checkpoint(1)
        configs = _configs(chunks, opt_config, fmt, load=str(tmp_path / fmt))
        assert load_checkpoint(chunks, optimizer, _scheduler(optimizer), configs).iteration == 2
        out[fmt] = _whole_state(chunks, optimizer)
    return out


def test_a_checkpoint_saved_at_tp2_loads_at_tp1(tmp_path):
    """TP=2 with sequence parallelism: the projections to heads saved as shards (rows), the
    down projections and latent norms once; at TP=1 every weight and Adam moment equals the
    saved run's, bitwise, in both formats."""
    fmts = ["torch_dist", "torch"]
    weights, optim, _ = run_distributed(_save_at_tp2, world_size=2, tmp_path=tmp_path,
                                        fmts=fmts)[0]
    assert any("linear_kv_up_proj" in name for name in weights)
    for fmt, (got, got_optim, _) in run_distributed(_load_at_tp1, world_size=1,
                                                    tmp_path=tmp_path, fmts=fmts)[0].items():
        assert got.keys() == weights.keys(), fmt
        for name, value in weights.items():
            assert torch.equal(got[name], value), (fmt, name)
        for key in ("exp_avg", "exp_avg_sq"):
            for name, value in optim[key].items():
                assert torch.equal(got_optim[key][name], value), (fmt, key, name)
