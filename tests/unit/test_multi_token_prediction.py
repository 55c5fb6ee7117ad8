"""Multi-token prediction (--mtp-num-layers): each depth's loss equals a plain-torch reference
built from the model's own weights (the depth's norms, projection and layer, the shared
embedding and head), the gradient of the total is the main loss's plus scale / D times the
depths' (checked against autograd on the reference), and under TP=2 with sequence
parallelism, PP=2 (tied embeddings, or untied: the last stage's own copy of the embedding)
and CP=2 (ring and all-gather) the losses and gradients equal one process.

Tolerance: the reference runs the same ops in the same order (exact up to the masked means'
summation, 1e-6); the parallel layouts re-associate fp32 sums (1e-5; CP 1e-6 as in
test_context_parallel_model)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.models import LlamaModel, llama_config
from megatron.core.transformer.moe.moe_layer import set_aux_loss_scale
from tests.distributed import run_distributed

VOCAB, SEQ, BATCH = 64, 12, 2


def _config(**overrides):
    return llama_config(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                                  num_query_groups=2, ffn_hidden_size=48, attention_dropout=0.0,
                                  hidden_dropout=0.0, mtp_num_layers=2,
                                  mtp_loss_scaling_factor=0.3), **overrides})


def _batch():
    g = torch.Generator().manual_seed(5)
    text = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = torch.ones(BATCH, SEQ)
    mask[0, 3] = 0  # a masked label: its shifted copies must be masked too
    return text[:, :-1], text[:, 1:], mask


def _reference_mtp_losses(model, tokens, labels, mask):
    """The depths written out from the definition with the model's parameters."""
    emb = model.embedding.word_embeddings.weight
    head = model.output_layer.weight
    hidden = model.embedding(tokens)
    cos, sin = model.rotary(torch.arange(SEQ).unsqueeze(0))
    for layer in model.decoder.layers:
        hidden = layer(hidden, None, cos, sin)
    losses = []
    for k, depth in enumerate(model.mtp.depths, start=1):
        ids = torch.roll(tokens, -k, dims=1)
        ids[:, -k:] = 0
        embedded = F.embedding(ids, emb).transpose(0, 1)
        joined = torch.cat([depth.hnorm(hidden), depth.enorm(embedded)], dim=-1)
        hidden = depth.layer(joined @ depth.eh_proj.t(), None, cos, sin)
        logits = depth.final_layernorm(hidden) @ head.t()  # [s, b, v]
        target = torch.roll(labels, -k, dims=1).transpose(0, 1)
        weight = torch.roll(mask, -k, dims=1)
        weight[:, -k:] = 0
        per_token = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1),
                                    reduction="none").view(SEQ, BATCH).t()
        losses.append((per_token * weight).sum() / weight.sum())
    return losses


def _one_process():
    torch.manual_seed(0)
    model = LlamaModel(_config(), VOCAB)
    tokens, labels, mask = _batch()
    main = model(tokens, labels=labels, loss_mask=mask)  # records the MTP losses
    sums, forwards = model.mtp.take_metrics()
    want = _reference_mtp_losses(model, tokens, labels, mask)
    return sums, forwards, want, main


def test_each_depth_loss_equals_the_reference():
    (sums, forwards, want, main), = run_distributed(_one_process, world_size=1, tp=1)
    assert forwards == 1 and len(want) == 2
    torch.testing.assert_close(sums, torch.stack(want).detach(), rtol=1e-6, atol=1e-6)
    assert (sums - main.mean().detach()).abs().min() > 1e-3  # not the main loss


def _gradients(scale_zero):
    """The model's gradients of (masked main mean), with the MTP losses attached."""
    set_aux_loss_scale(1.0)  # what a schedule sets per microbatch (one microbatch here)
    torch.manual_seed(0)
    config = _config(mtp_loss_scaling_factor=0.0) if scale_zero else _config()
    model = LlamaModel(config, VOCAB)
    tokens, labels, mask = _batch()
    per_token = model(tokens, labels=labels, loss_mask=mask)
    ((per_token * mask).sum() / mask.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # the reference: main mean + 0.3 / 2 * sum of the depths' reference losses
    model.zero_grad()
    per_token = model(tokens, labels=labels, loss_mask=mask)
    main = (per_token * mask).sum() / mask.sum()
    total = main + 0.3 / 2 * sum(_reference_mtp_losses(model, tokens, labels, mask))
    total.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, want


def test_the_gradient_is_the_main_loss_plus_the_scaled_depth_losses():
    (grads, want), = run_distributed(_gradients, world_size=1, tp=1, scale_zero=False)
    assert set(grads) == set(want) and any("mtp" in n for n in grads)
    (grads0, _), = run_distributed(_gradients, world_size=1, tp=1, scale_zero=True)
    for name in want:
        # attached MTP gradient = grads - grads0 (no MTP); reference MTP gradient =
        # want - grads (the reference added its own copy on top of the attached one)
        torch.testing.assert_close(grads[name] - grads0.get(name, 0 * grads[name]),
                                   want[name] - grads[name], rtol=1e-5, atol=1e-6, msg=name)


def _layout_run(tied=True):
    """Per-token main loss summed and the depth losses, and every gradient merged to full
    tensors, at TP (with SP) x PP, tied or untied embeddings."""
    from megatron.core.models.tp_sharding import merge_state_dicts
    from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
    from megatron.core.pipeline_parallel.tied_embeddings import allreduce_tied_embedding_grads

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    set_aux_loss_scale(1.0)
    torch.manual_seed(0)
    config = _config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                     pipeline_model_parallel_size=pp)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    layers = config.num_layers // pp
    stage = ps.get_pipeline_model_parallel_rank()
    model = LlamaModel(config, VOCAB, pre_process=first, post_process=last,
                       share_embeddings_and_output_weights=tied,
                       layer_range=(stage * layers, (stage + 1) * layers))
    from megatron.core.pipeline_parallel.tied_embeddings import sync_tied_embedding_weights
    initial = model.shared_embedding_or_output_weight()  # before the sync: the same init
    initial = None if initial is None else initial.detach().clone()
    sync_tied_embedding_weights([model])
    tokens, labels, mask = _batch()
    if first:
        out = model(tokens)
        if pp > 1:
            dist.send(out.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
            grad = torch.empty_like(out)
            dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
            out.backward(grad)
    if last and pp > 1:
        hidden = torch.empty(SEQ // tp, BATCH, 32)
        dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
        hidden.requires_grad_()
        model.set_input_tensor(hidden)
    if last:
        per_token = model(tokens, labels=labels, loss_mask=mask)
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        if pp > 1:
            dist.send(hidden.grad, ps.get_pipeline_model_parallel_prev_rank())
    allreduce_sequence_parallel_grads([model])
    allreduce_tied_embedding_grads([model])
    local = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if not first:  # the last stage's copy (tied output layer, or MTP's) is the embedding
        copy = "output_layer.weight" if tied else "mtp.word_embeddings.weight"
        local = {("embedding.word_embeddings.weight" if n == copy else n): g
                 for n, g in local.items()}
    offset = stage * layers
    local = {(f"decoder.layers.{int(n.split('.')[2]) + offset}." +
              ".".join(n.split(".")[3:]) if n.startswith("decoder.layers.") else n): g
             for n, g in local.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (local, ps.get_tensor_model_parallel_rank()))
    merged = {}
    for stage_ranks in (everyone,):
        tp_parts = {}
        for grads, rank in stage_ranks:
            for n, g in grads.items():
                tp_parts.setdefault(n, {})[rank] = g
    for n, parts in tp_parts.items():
        shards = [parts[r] for r in sorted(parts)]
        merged[n] = merge_state_dicts([{n: s} for s in shards], True,
                                      [(r, 0, 0) for r in sorted(parts)])[n] \
            if len(shards) > 1 else shards[0]
    metrics = model.mtp.take_metrics()[0] if last else None
    return merged, metrics, (ps.get_tensor_model_parallel_rank(), initial)


@pytest.mark.parametrize("tp,pp,tied", [(2, 1, True), (1, 2, True), (1, 2, False),
                                        (2, 2, False)])
def test_tensor_and_pipeline_parallel_equal_one_process(tp, pp, tied):
    (want, want_metrics, _), = run_distributed(_layout_run, world_size=1, tp=1, pp=1,
                                               tied=tied)
    results = run_distributed(_layout_run, world_size=tp * pp, tp=tp, pp=pp, tied=tied)
    if pp > 1:  # the last stage's copy of the embedding starts equal to it, before any sync
        initial = {}
        for _, _, (tp_rank, weight) in results:
            initial.setdefault(tp_rank, []).append(weight)
        for first_stage, last_stage in initial.values():
            assert torch.equal(first_stage, last_stage)
    metrics = [m for _, m, _ in results if m is not None]
    torch.testing.assert_close(metrics[0], want_metrics, rtol=1e-5, atol=1e-6)
    got = {}
    for grads, _, _ in results:
        got.update(grads)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_learned_positions_under_pipeline_parallelism_are_refused_with_the_reason():
    """The last stage's lookups have no position table (at PP 1 the embedding adds them)."""
    with pytest.raises(ValueError, match="multi-token prediction under pipeline parallelism "
                                         ".*learned position embeddings"):
        _config(pipeline_model_parallel_size=2, position_embedding_type="learned_absolute")
    _config(pipeline_model_parallel_size=2)  # RoPE
    _config(position_embedding_type="learned_absolute")  # PP 1


def _global_layer(name, offset):
    if not name.startswith("decoder.layers."):
        return name
    _, _, index, rest = name.split(".", 3)
    return f"decoder.layers.{int(index) + offset}.{rest}"


def _estimated_and_real_parameters(moe):
    from megatron.core.transformer.moe.moe_config import MoEConfig
    from megatron.training.memory.params import rank_chunks

    tp = ps.get_tensor_model_parallel_world_size()
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    extra = dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                 pipeline_model_parallel_size=pp)
    if moe:  # the MTP layer takes the last layer's kind: experts (layer 1 is dense)
        extra.update(moe=MoEConfig(num_moe_experts=4, moe_ffn_hidden_size=16,
                                   moe_layer_freq=[0, 1]), add_bias_linear=False)
    config = _config(**extra)
    layers = config.num_layers // pp
    model = LlamaModel(config, VOCAB, pre_process=stage == 0, post_process=stage == pp - 1,
                       layer_range=(stage * layers, (stage + 1) * layers))
    real = [(_global_layer(n, stage * layers), p.numel(),
             getattr(p, "tied_across_stages", False)) for n, p in model.named_parameters()]
    (shapes, alone), = rank_chunks(config, VOCAB, stage,
                                   share_embeddings_and_output_weights=False)
    return real, [(s.name, s.numel, alone(s)) for s in shapes]


@pytest.mark.parametrize("tp,pp,moe", [(2, 1, False), (1, 1, True), (1, 2, False)])
def test_the_memory_estimate_lists_every_mtp_parameter_in_order(tp, pp, moe):
    """Names, sizes and (sharded, the embedding's two copies at PP=2, untied: MTP's on the
    last stage) which parameters get a bucket of their own."""
    results = run_distributed(_estimated_and_real_parameters, world_size=tp * pp, tp=tp,
                              pp=pp, moe=moe)
    for real, estimated in results:
        assert estimated == real
    assert any(name.startswith("mtp.") for name, _, _ in results[-1][0])
    assert sum(alone for real, _ in results for _, _, alone in real) == (2 if pp > 1 else 0)


def test_the_flop_count_adds_a_layer_a_projection_and_the_logits_per_depth():
    from megatron.training.logging.flops import num_floating_point_operations

    h, v, s, b = 64, 1000, 128, 4
    common = dict(hidden_size=h, ffn_hidden_size=256, num_attention_heads=4,
                  num_query_groups=2, seq_length=s, vocab_size=v, batch_size=b, swiglu=True)
    plain = num_floating_point_operations(num_layers=3, **common)
    with_mtp = num_floating_point_operations(num_layers=2, mtp_num_layers=1, **common)
    # one more layer (counted as a layer of the model) plus its [2h -> h] projection and the
    # logits GEMM again: 3 (fwd + bwd) x 2 (FLOPs per MAC) x tokens x MACs per token
    assert with_mtp - plain == 6 * b * s * (2 * h * h + h * v)
    # a windowed MTP layer counts only its window's pairs
    windowed = num_floating_point_operations(num_layers=2, mtp_num_layers=1,
                                             windows=[None, None, 7], **common)
    assert windowed < with_mtp


def test_the_planner_charges_the_depths_to_the_stage_with_the_logits():
    """The planner's count: the last stage's logits part carries the MTP depths, so the whole
    model's (its MFU numerator) equals the training log's count with them."""
    from megatron.training.logging.flops import num_floating_point_operations
    from megatron.training.planner import step_time

    config = _config()
    s, b, v = 64, 8, VOCAB
    whole = step_time._flops(config, s, b, config.num_layers, v)
    want = num_floating_point_operations(
        config.num_layers, config.hidden_size, config.ffn_hidden_size,
        config.num_attention_heads, config.num_query_groups, s, v, b, True,
        config.kv_channels, mtp_num_layers=2)
    assert whole == want
    without = step_time._flops(_config(mtp_num_layers=None), s, b, config.num_layers, v)
    assert step_time._flops(config, s, b, 0, v) - step_time._flops(
        _config(mtp_num_layers=None), s, b, 0, v) == whole - without > 0
    assert step_time._flops(config, s, b, 1, 0) == step_time._flops(
        _config(mtp_num_layers=None), s, b, 1, 0)  # a stage without the logits: no depths


def _context_parallel_run(comm_type="p2p", sp=False):
    """The reported main loss, each depth's loss and every reduced gradient (TP shards
    merged) through the scripts' loss and DDP, one microbatch, at this rank's CP."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.tp_sharding import merge_state_dicts
    from megatron.training import gpt_step
    from megatron.training.data.batch import shard_for_context_parallel
    from megatron.training.training import build_model

    tp = ps.get_tensor_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    set_aux_loss_scale(1.0 * cp)  # what the schedule sets: x CP, like the main loss
    config = _config(tensor_model_parallel_size=tp, sequence_parallel=sp,
                     context_parallel_size=cp, cp_comm_type=comm_type)
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                        DistributedDataParallelConfig(), seed=42)[0]
    tokens, labels, mask = _batch()
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    tokens, labels, mask, positions = shard_for_context_parallel(tokens, labels, mask,
                                                                 positions)
    per_token = model(tokens, position_ids=positions, labels=labels, loss_mask=mask)
    loss, reported = gpt_step.loss_func(mask, per_token)
    loss.backward()
    finalize_model_grads([model])
    grads = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, grads)
    mine = everyone[ps.get_context_parallel_rank() * tp:][:tp]  # this CP rank's TP ranks
    merged = merge_state_dicts(mine, gated_mlp=True) if tp > 1 else grads
    sums, forwards = model.module.mtp.take_metrics()
    assert forwards == 1
    return float(reported["lm loss"]), sums, merged


@pytest.mark.parametrize("tp,comm_type", [(1, "p2p"), (1, "all_gather"), (2, "p2p")])
def test_context_parallel_equals_one_process(tp, comm_type):
    """CP = 2 (with TP = 2 and SP: 4 ranks): the shifted tokens, labels and mask come from
    the whole sequence, the depths' attention runs under CP and their masked means are the
    global ones. 1e-6 relative: CP re-associates the fp32 sums (the ring's log-sum-exp)."""
    (want_loss, want_mtp, want), = run_distributed(_context_parallel_run, world_size=1, tp=1)
    for loss, mtp, grads in run_distributed(_context_parallel_run, world_size=2 * tp, tp=tp,
                                            cp=2, comm_type=comm_type, sp=tp > 1):
        assert loss == pytest.approx(want_loss, rel=1e-6)
        torch.testing.assert_close(mtp, want_mtp, rtol=1e-6, atol=0)
        assert grads.keys() == want.keys() and any(n.startswith("mtp.") for n in want)
        for name, grad in grads.items():
            scale = want[name].abs().max().item()
            assert scale > 0, name
            assert (grad - want[name]).abs().max().item() <= 1e-6 * scale, name
