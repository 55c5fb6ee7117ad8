"""QK-clip wired into training (--qk-clip: optimizer/qk_clip.py's QKClip, the attention's
recording in transformer/attention_logits.py, the step's row_scales).

- Recording: the max logit each attention path records (causal, sliding window, packed
  documents with and without document ids, an explicit mask, attention sinks) is the max of
  the explicit [b, heads, s, s] logits over the entries attended.
- One process, by hand: after one train_step the fused QKV weight is the unclipped twin's
  updated weight with each head's query rows times gamma^alpha and its group's key rows times
  (min gamma)^(1 - alpha), value rows untouched (gamma from Q K^T of the step's forward, by
  einsum over the causal mask); every other parameter and the loss bitwise the twin's (the
  recording changes nothing); at lr 0 the next forward's max logit per head is <= tau.
- Layouts: TP=2, PP=2, DP=2 with the distributed optimizer (a shard boundary inside a QKV
  row; with --overlap-param-gather too), CP=2 with packed documents and a window, FSDP2, CPU
  offload, and multi-latent attention at TP=2 equal one process within 1e-6 after two
  clipped steps; bf16 main params and the model's agree (replicated or sharded); the clip
  really changed the weights (an unclipped run differs).
"""
import math

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models import LlamaModel, llama_config
from megatron.core.models.tp_sharding import merge_state_dicts
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.qk_clip import QKClip
from megatron.core.packed_seq_params import packed_seq_params_from_eod
from megatron.training import gpt_step
from megatron.training.data.batch import shard_for_context_parallel
from megatron.training.training import build_model, train_step
from tests.distributed import run_distributed

VOCAB, SEQ, MBS, EOD = 64, 16, 2, 7
HEADS, GROUPS, HIDDEN = 8, 4, 32
TOL = 1e-6


def _config(**kw):
    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                num_query_groups=GROUPS, ffn_hidden_size=48, max_position_embeddings=SEQ,
                init_method_std=0.2)  # logits of a few units
    return llama_config(**{**base, **kw})


# --- recording: the entries each attention path attends --------------------------------------

def _explicit_max(q, k, allowed, scale):
    """The explicit [b, heads, s, s] softmax input, masked -> [heads] max."""
    k = k.repeat_interleave(q.size(2) // k.size(2), dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale
    return logits.masked_fill(~allowed[:, None], float("-inf")).amax(dim=(0, 2, 3))


def _recorded_vs_explicit(case):
    from megatron.core.transformer.attention import SelfAttention
    torch.manual_seed(3)
    b, s = 2, 12
    kw = dict(log_max_attention_logit=True, max_position_embeddings=s)
    if case == "window":
        kw["window_size"] = (3, 0)
    if case == "sinks":
        kw["softmax_type"] = "learnable"
    attention = SelfAttention(_config(**kw), layer_number=1)
    captured = {}
    inner = attention._attention

    def spy(query, key, *rest):  # the Q and K (RoPE applied) the kernels get
        captured.update(q=query.detach(), k=key.detach())
        return inner(query, key, *rest)
    attention._attention = spy
    hidden = torch.randn(s, b, HIDDEN)
    i = torch.arange(s)
    causal = (i[:, None] >= i[None, :]).expand(b, s, s)
    mask, packed, allowed = None, None, causal
    if case == "window":
        allowed = causal & (i[:, None] - i[None, :] <= 3)
    if case.startswith("documents"):
        tokens = torch.randint(8, VOCAB, (b, s))
        tokens[0, 3], tokens[0, 8], tokens[1, 5] = EOD, EOD, EOD
        packed = packed_seq_params_from_eod(tokens, EOD)
        if case == "documents-without-ids":
            packed = type(packed)(packed.cu_seqlens, packed.max_seqlen, packed.seqlens, None)
        doc = torch.cumsum((tokens == EOD).long(), 1) - (tokens == EOD).long()
        allowed = causal & (doc[:, :, None] == doc[:, None, :])
    if case == "mask":  # Megatron's convention: True = not attended; here a prefix-LM-like one
        allowed = causal.clone()
        allowed[1, :4, :4] = True
        mask = (~allowed)[:, None]
    attention(hidden, mask, packed_seq_params=packed)
    want = _explicit_max(captured["q"], captured["k"], allowed, 1 / math.sqrt(HIDDEN // HEADS))
    first = attention.max_logits.clone()
    attention(hidden * 0.5, mask, packed_seq_params=packed)  # a smaller second microbatch
    return first, want.float(), attention.max_logits


@pytest.mark.parametrize("case", ["causal", "window", "documents", "documents-without-ids",
                                  "mask", "sinks"])
def test_recorded_max_is_the_max_over_the_attended_entries(case):
    got, want, after_second = run_distributed(_recorded_vs_explicit, world_size=1, tp=1,
                                              case=case)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(after_second, got)  # a running max over the microbatches


def test_a_piece_of_a_flattened_weight_gets_its_rows_factors():
    """The distributed optimizer's pieces start and end anywhere in a row."""
    from megatron.core.optimizer.optimizer import scale_rows_of_range_
    weight, factors = torch.randn(7, 5), torch.rand(7) + 0.5
    want = (weight * factors[:, None]).view(-1)
    for begin, end in ((0, 35), (3, 4), (3, 9), (5, 20), (12, 33), (0, 2), (34, 35)):
        piece = weight.reshape(-1)[begin:end].clone()
        scale_rows_of_range_(piece, begin, end, 5, factors)
        assert torch.equal(piece, want[begin:end]), (begin, end)


# --- one process against a computation by hand ----------------------------------------------

def _batch(seed=11, packed=False):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(8, VOCAB, (MBS, SEQ + 1), generator=g)
    if packed:  # documents [0, 5), [5, 12), [12, 16) in sample 0, [0, 9), [9, 16) in sample 1
        text[0, 4], text[0, 11], text[1, 8] = EOD, EOD, EOD
    return text[:, :-1].contiguous(), text[:, 1:].contiguous()


def _forward_step(data_iterator, model):
    """The scripts' step: CP-sharded tokens and positions under CP, gpt_step's loss."""
    tokens, labels = next(data_iterator)
    packed = packed_seq_params_from_eod(tokens, EOD) if (tokens == EOD).any() else None
    positions = torch.arange(SEQ).expand(MBS, SEQ)
    loss_mask = torch.ones(MBS, SEQ)
    tokens, labels, loss_mask, positions = shard_for_context_parallel(
        tokens, labels, loss_mask, positions)
    output = model(tokens, position_ids=positions, labels=labels, packed_seq_params=packed)
    return output, lambda out: gpt_step.loss_func(loss_mask, out)


def _model_and_optimizer(config, lr, distributed=False, dtype=torch.float32, fsdp2=False,
                         optimizer="muon", offload=False, **ddp_kw):
    if fsdp2:
        from megatron.core.distributed.fsdp import TorchFSDP2Config
        ddp = TorchFSDP2Config()
    else:
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=distributed,
                                            grad_reduce_in_fp32=True, **ddp_kw)
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config, ddp,
                        seed=42)
    mixed = dict(bf16=True, params_dtype=dtype) if dtype != torch.float32 else {}
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer=optimizer, lr=lr, weight_decay=0.1, clip_grad=0.0,
        use_distributed_optimizer=distributed, optimizer_cpu_offload=offload, **mixed), model)
    return model, opt


def _qkv_by_hand(model, tokens):
    """Each layer's [heads] max logit of a forward on ``tokens`` (no RoPE: Q and K are the
    QKV output), by einsum over the causal mask."""
    outputs = []
    hooks = [layer.self_attention.linear_qkv.register_forward_hook(
        lambda m, i, o: outputs.append(o[0].detach()))
        for layer in model[0].module.decoder.layers]
    with torch.no_grad():
        model[0](tokens)
    for hook in hooks:
        hook.remove()
    d, per = HIDDEN // HEADS, HEADS // GROUPS
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().expand(MBS, SEQ, SEQ)
    maxima = []
    for qkv in outputs:
        qkv = qkv.transpose(0, 1).reshape(MBS, SEQ, GROUPS, per + 2, d)
        q, k = qkv[:, :, :, :per].reshape(MBS, SEQ, HEADS, d), qkv[:, :, :, per]
        maxima.append(_explicit_max(q, k, causal, 1 / math.sqrt(d)).float())
    return maxima


def _scaled_by_hand(weight, bias, gamma, alpha):
    """Query rows of head h times gamma_h^alpha, the group's key rows times min(gamma over the
    group)^(1 - alpha), value rows untouched."""
    d, per = HIDDEN // HEADS, HEADS // GROUPS
    weight, bias = weight.clone().view(GROUPS, per + 2, d, -1), bias.clone().view(GROUPS,
                                                                                 per + 2, d)
    for g in range(GROUPS):
        for p in range(per):
            weight[g, p] *= gamma[g * per + p] ** alpha
            bias[g, p] *= gamma[g * per + p] ** alpha
        key = gamma[g * per:(g + 1) * per].min() ** (1 - alpha)
        weight[g, per] *= key
        bias[g, per] *= key
    return weight.view(-1, HIDDEN), bias.view(-1)


def _one_step_by_hand(lr, alpha):
    tokens, labels = _batch()
    runs = {}
    for clip in (False, True):
        config = _config(position_embedding_type="none", add_qkv_bias=True, qk_clip=clip,
                         qk_clip_alpha=alpha)
        model, optimizer = _model_and_optimizer(config, lr)
        before = _qkv_by_hand(model, tokens)
        # tau between the heads' maxima: some heads clipped, some not
        tau = 0.5 * (min(m.min() for m in before) + max(m.max() for m in before))
        config.qk_clip_threshold = float(tau)
        report, skipped, _, _ = train_step(_forward_step, iter([(tokens, labels)]), model,
                                           optimizer, None, 1, SEQ, MBS)
        assert not skipped
        runs[clip] = (model, before, float(report["lm loss"]), float(tau))
    (plain, before, plain_loss, tau), (clipped, before_clip, clip_loss, _) = runs[False], \
        runs[True]
    assert clip_loss == plain_loss and all(torch.equal(a, b) for a, b in zip(before,
                                                                              before_clip))
    plain_params = dict(plain[0].module.named_parameters())
    mismatched, not_clipped = [], []
    clipped_heads = 0
    for name, param in clipped[0].module.named_parameters():
        if "linear_qkv" not in name:
            if not torch.equal(param, plain_params[name]):
                mismatched.append(name)
            continue
        if name.endswith("bias"):
            continue
        layer = int(name.split(".")[2])
        gamma = torch.where(before[layer] > tau, tau / before[layer], torch.ones(HEADS))
        clipped_heads += int((gamma < 1).sum())
        want_w, want_b = _scaled_by_hand(plain_params[name], plain_params[
            name.replace("weight", "bias")], gamma, alpha)
        bias = dict(clipped[0].module.named_parameters())[name.replace("weight", "bias")]
        for got, want in ((param, want_w), (bias, want_b)):
            if not torch.allclose(got, want, rtol=1e-6, atol=0):
                not_clipped.append((name, (got - want).abs().max().item()))
        if torch.equal(param, plain_params[name]):
            not_clipped.append((name, "unchanged"))
    after = _qkv_by_hand(clipped, tokens)
    return mismatched, not_clipped, clipped_heads, [m.max().item() for m in after], tau


@pytest.mark.parametrize("lr,alpha", [(0.0, 0.5), (2e-2, 0.5), (2e-2, 0.3)])
def test_one_step_equals_the_rescale_by_hand(lr, alpha):
    mismatched, wrong, clipped_heads, after, tau = run_distributed(
        _one_step_by_hand, world_size=1, tp=1, lr=lr, alpha=alpha)[0]
    assert mismatched == [] and wrong == []
    assert 0 < clipped_heads < 2 * HEADS  # some heads clipped, some left alone
    if lr == 0:  # the weights the logits were measured on: every head ends <= tau (layer 0:
        # the later layers' inputs changed with the clip of the layers below them)
        assert after[0] <= tau * (1 + 1e-5), (after, tau)


# --- layouts against one process ------------------------------------------------------------

TAU = 4.0  # the init's maxima are 3.5-5 per head
STEPS = 2


def _train(steps, clip=True, dtype=torch.float32, model_kw=None, tau=TAU, **kw):
    """Two train_steps with clipping; one process runs the DP ranks' batches as microbatches.
    Returns (TP rank, DP rank, CP rank, params (fp32), the per-layer reduced maxima of step 1,
    _shard_checks' (distributed), step 1's max logit over the whole model)."""
    config = _config(qk_clip=clip, qk_clip_threshold=tau, **(model_kw or {}),
                     tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                     context_parallel_size=ps.get_context_parallel_world_size(),
                     pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                     params_dtype=dtype)
    model, optimizer = _model_and_optimizer(config, lr=1e-2, dtype=dtype, **kw)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    packed = config.window_size is not None
    qk_clip = QKClip.for_model(model)
    maxima, checks, top = [], {}, None
    for step in range(steps):
        batches = [_batch(seed=100 * step + i, packed=packed) for i in range(2)]
        mine = batches[dp_rank::dp] if dp > 1 else batches
        _, skipped, _, _ = train_step(_forward_step, iter(mine), model, optimizer, None,
                                      len(mine), SEQ, MBS, qk_clip=qk_clip)
        assert not skipped
        if step == 0 and qk_clip is not None:
            maxima = [m.clone() for m in qk_clip.reduced_maxima()]
            top = qk_clip.max_logit.item()
    if kw.get("distributed"):
        model[0].finish_param_sync()
        checks = _shard_checks(optimizer)
    elif dtype != torch.float32:  # replicated: the fp32 main copies, rounded, are the model
        checks = {"main_equals_model": all(
            torch.equal(model_param, main.detach().to(model_param.dtype))
            for main, model_param in optimizer._model_of.items())}
    if kw.get("fsdp2"):
        params = {n: p.full_tensor().detach().float().clone()
                  for n, p in model[0].module.named_parameters()}
    else:
        params = {n: p.detach().float().clone() for n, p in model[0].module.named_parameters()}
    return (ps.get_tensor_model_parallel_rank(), dp_rank, ps.get_context_parallel_rank(),
            params, maxima, checks, top)


def _shard_checks(optimizer):
    """Whether some QKV piece starts or ends inside a query or key row (the partial-row path
    ran on factors that are not 1), and whether the model's params are the main shards
    (rounded to their dtype: bf16)."""
    mid_row, agree = False, True
    for shard in optimizer.shards:
        for piece, param, begin, end, _ in shard.pieces:
            flat = param.detach().view(-1)[begin:end]
            agree &= torch.equal(flat, piece.detach().to(flat.dtype))
            per_row = param.numel() // param.shape[0]
            rows_per_group = (HEADS // GROUPS + 2) * (HIDDEN // HEADS)
            value_rows = rows_per_group - HIDDEN // HEADS
            if "linear_qkv.weight" in optimizer._names[param]:
                mid_row |= any(pos % per_row and pos // per_row % rows_per_group < value_rows
                               for pos in (begin, end))
    return {"mid_row": mid_row, "main_equals_model": agree}


def _merged(results, tp):
    """One DP/CP rank's TP shards merged into whole parameters."""
    shards = sorted([r for r in results if r[1] == 0 and r[2] == 0], key=lambda r: r[0])
    if tp == 1:
        return shards[0][3]
    return merge_state_dicts([r[3] for r in shards], gated_mlp=True)


def _assert_close(got, want, tol=TOL, loose=()):
    """Within ``tol``; the names in ``loose`` within 10x (see the MLA test)."""
    assert got.keys() == want.keys()
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= (10 * tol if name in loose else tol), (name, err)


@pytest.fixture(scope="module")
def one_process():
    return run_distributed(_train, world_size=1, tp=1, steps=STEPS)[0]


@pytest.fixture(scope="module")
def unclipped():
    return run_distributed(_train, world_size=1, tp=1, steps=STEPS, clip=False)[0]


def test_clipping_is_active_in_the_layout_runs(one_process, unclipped):
    """The reference clips some heads (tau between the heads' maxima): its QKV weights differ
    from an unclipped run's."""
    maxima = one_process[4]
    assert all(m.max() > TAU for m in maxima) and any(m.min() < TAU for m in maxima)
    qkv = [n for n in one_process[3] if "linear_qkv" in n]
    assert qkv and all((one_process[3][n] - unclipped[3][n]).abs().max() > 1e-4 for n in qkv)


@pytest.mark.slow
def test_tp2_equals_one_process(one_process):
    results = run_distributed(_train, world_size=2, tp=2, steps=STEPS)
    _assert_close(_merged(results, 2), one_process[3])
    assert [r[6] for r in results] == pytest.approx([one_process[6]] * 2, rel=1e-5)  # over TP
    for r in results:  # each TP rank's reduced maxima are its heads' of the whole model's
        rank_heads = slice(r[0] * HEADS // 2, (r[0] + 1) * HEADS // 2)
        for mine, whole in zip(r[4], one_process[4]):
            torch.testing.assert_close(mine, whole[rank_heads], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_pp2_stages_clip_their_layers_and_log_the_whole_models_max(one_process):
    """Pipeline stages own their layers: each stage's QKV weights and maxima are one
    process's, and the logged max is over every layer (over TP too: the test above)."""
    results = run_distributed(_train, world_size=2, tp=1, pp=2, steps=STEPS)
    for stage, result in enumerate(results):
        qkv = [n for n in result[3] if "linear_qkv" in n]
        assert len(qkv) == 1
        whole = f"decoder.layers.{stage}.self_attention.linear_qkv.weight"
        assert (result[3][qkv[0]] - one_process[3][whole]).abs().max().item() <= TOL
        torch.testing.assert_close(result[4][0], one_process[4][stage], rtol=1e-6, atol=0)
    assert [r[6] for r in results] == pytest.approx([one_process[6]] * 2, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["gather", "overlap-param-gather"])
def test_dp2_distributed_optimizer_equals_one_process(one_process, overlap):
    """Each DP rank sees its own batch: the maxima are all-reduced over DP (one process saw
    both as microbatches); buckets of 3250 elements cut the second layer's QKV weight inside a
    key row (element 1808, 32-element rows) between the ranks' shards."""
    results = run_distributed(_train, world_size=2, tp=1, steps=STEPS, distributed=True,
                              bucket_size=3250, overlap_param_gather=overlap)
    for r in results:
        _assert_close(r[3], one_process[3])
        for mine, whole in zip(r[4], one_process[4]):
            torch.testing.assert_close(mine, whole, rtol=1e-6, atol=0)
        assert r[5]["main_equals_model"]
    assert any(r[5]["mid_row"] for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed"])
def test_dp2_bf16_main_params_reach_the_model(distributed):
    """bf16 params, fp32 main params (whole, or the distributed optimizer's shards): the clip
    is applied to the main params and the model holds them rounded, on every rank (the
    all-gather spread the owners' clipped rows); the clip is active."""
    kw = dict(steps=STEPS, distributed=distributed, dtype=torch.bfloat16, bucket_size=3250)
    results = run_distributed(_train, world_size=2, tp=1, **kw)
    plain = run_distributed(_train, world_size=2, tp=1, clip=False, **kw)
    assert all(r[5]["main_equals_model"] for r in results)
    for name in results[0][3]:
        assert torch.equal(results[0][3][name], results[1][3][name]), name
    assert all(not torch.equal(results[0][3][n], plain[0][3][n]) for n in results[0][3]
               if "linear_qkv" in n)


@pytest.mark.slow
def test_cp2_packed_documents_and_window_equal_one_process():
    """CP=2: each rank's queries against the whole sequence's keys (gathered), at their global
    positions, within documents and a window of 5; reduced over CP."""
    model_kw = dict(window_size=(5, 0))
    want = run_distributed(_train, world_size=1, tp=1, steps=STEPS, model_kw=model_kw)[0]
    results = run_distributed(_train, world_size=2, cp=2, steps=STEPS, model_kw=model_kw)
    assert all(m.max() > TAU for m in want[4])
    for r in results:
        _assert_close(r[3], want[3])
        for mine, whole in zip(r[4], want[4]):
            torch.testing.assert_close(mine, whole, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_fsdp2_with_adam_equals_one_process():
    """FSDP2 (Adam: Muon is not built there): each rank scales its rows of the DTensors."""
    want = run_distributed(_train, world_size=1, tp=1, steps=STEPS, optimizer="adam")[0]
    plain = run_distributed(_train, world_size=1, tp=1, steps=STEPS, optimizer="adam",
                            clip=False)[0]
    assert any(not torch.equal(want[3][n], plain[3][n]) for n in want[3] if "qkv" in n)
    results = run_distributed(_train, world_size=2, tp=1, steps=STEPS, fsdp2=True,
                              optimizer="adam")
    for r in results:
        _assert_close(r[3], want[3])


MLA_TAU = 2.0  # its init's maxima are 1.4-3 per head


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed"])
def test_cpu_offload_equals_the_device_optimizer(distributed):
    """--optimizer-cpu-offload: the host main params are clipped, then copied to the model."""
    kw = dict(steps=STEPS, optimizer="adam", distributed=distributed, bucket_size=3250)
    want = run_distributed(_train, world_size=2, tp=1, **kw)
    got = run_distributed(_train, world_size=2, tp=1, offload=True, **kw)
    for a, b in zip(got, want):
        _assert_close(a[3], b[3])


def _latent(**kw):
    return dict(multi_latent_attention=True, num_query_groups=None, q_lora_rank=16,
                kv_lora_rank=12, qk_head_dim=4, qk_pos_emb_head_dim=2, v_head_dim=4,
                qk_layernorm=True, **kw)


@pytest.mark.slow
def test_latent_attention_tp2_equals_one_process():
    """MLA: the query up-projection's rows (rotary part by gamma, the rest gamma^alpha) and
    the KV up-projection's key rows; at TP=2 each rank its heads'."""
    mla = dict(model_kw=_latent(), tau=MLA_TAU)
    want = run_distributed(_train, world_size=1, tp=1, steps=STEPS, **mla)[0]
    plain = run_distributed(_train, world_size=1, tp=1, steps=STEPS, clip=False, **mla)[0]
    assert all(m.max() > MLA_TAU for m in want[4])
    for name in ("linear_q_up_proj", "linear_kv_up_proj"):
        changed = [n for n in want[3] if name in n]
        assert changed and all(not torch.equal(want[3][n], plain[3][n]) for n in changed)
    results = run_distributed(_train, world_size=2, tp=2, steps=STEPS, **mla)
    # The word embeddings differ by 2.4e-6 with or without the clip: AdamW's first steps
    # divide tiny gradients (rows of tokens seen once) by their own size, which the TP
    # reduction order moves; everything else within 1e-6.
    _assert_close(_merged(results, 2), want[3], loose={"embedding.word_embeddings.weight"})


def _latent_bound():
    """lr 0: after the clip, the same batch's max logit per head is <= tau (one layer: a
    later layer's input changes with the clip of the layers below it)."""
    config = _config(qk_clip=True, qk_clip_threshold=MLA_TAU, **_latent(num_layers=1))
    model, optimizer = _model_and_optimizer(config, lr=0.0)
    qk_clip = QKClip.for_model(model)
    batch = _batch()
    maxima = []
    for _ in range(2):
        train_step(_forward_step, iter([batch]), model, optimizer, None, 1, SEQ, MBS,
                   qk_clip=qk_clip)
        maxima.append(qk_clip.reduced_maxima()[0])
    return maxima


def test_latent_attention_clip_bounds_the_next_forward():
    before, after = run_distributed(_latent_bound, world_size=1, tp=1)[0]
    assert before.max() > MLA_TAU and before.min() < MLA_TAU  # some heads clipped
    assert after.max() <= MLA_TAU * (1 + 1e-5), after
    unclipped = before <= MLA_TAU
    assert torch.equal(after[unclipped], before[unclipped])
