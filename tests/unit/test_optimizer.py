"""The Megatron optimizer against plain torch: loss scaling, mixed precision, param groups,
clipping and checkpoints.

Everything that steps runs on one rank (``run_distributed(world_size=1, tp=1)``): the optimizer
all-reduces its inf check and grad norm over the model-parallel group even then. Models are
tiny LLaMAs (hidden 32, 2 layers, seq 16): bf16/fp16 matmuls are ~100x slower than fp32 on CPU.
"""
import io
import math

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models import GPTModel, LlamaModel, llama_config
from megatron.core.optimizer import ConstantGradScaler, DynamicGradScaler, OptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer, get_param_groups
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.distributed import run_distributed

VOCAB, SEQ, MBS = 64, 16, 2
ADAM = dict(optimizer="adam", lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95)
SGD = dict(optimizer="sgd", lr=0.1, weight_decay=0.1, sgd_momentum=0.9)


# --- helpers (run inside a rank) ---------------------------------------------------------------

def _batches(steps, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
             torch.randint(0, VOCAB, (MBS, SEQ), generator=g)) for _ in range(steps)]


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach()}
    return model(tokens, labels=labels), loss_func


def _llama(dtype=torch.float32, seed=42):
    """fp32 init from ``seed``, then copied into a model built in ``dtype``: same weights."""
    torch.manual_seed(seed)
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
              ffn_hidden_size=48, max_position_embeddings=SEQ)
    model = LlamaModel(llama_config(**kw), VOCAB)
    if dtype != torch.float32:
        state = model.state_dict()
        model = LlamaModel(llama_config(params_dtype=dtype, **kw), VOCAB)
        model.load_state_dict(state)  # casts to dtype
    return model


def _build(dtype=torch.float32, ddp=True, seed=42, **opt):
    model = _llama(dtype, seed)
    config = model.config
    if ddp:
        model = DDP(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, params_dtype=dtype, **opt),
        [model])
    if optimizer.grad_scaler is not None:
        config.grad_scale_func = optimizer.scale_loss  # gradients really are scaled
    return model, optimizer


def _forward_backward(model, optimizer, batch, inject_inf=False):
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    optimizer.zero_grad()
    out = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter([batch]), model=[model],
        num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS)
    if inject_inf:
        next(model.parameters()).main_grad.view(-1)[3] = float("inf")
    return out[0]["lm loss"].item()


def _train(model, optimizer, batches, inf_at=()):
    results = []
    for i, batch in enumerate(batches):
        _forward_backward(model, optimizer, batch, inject_inf=i in inf_at)
        results.append(optimizer.step())
    return results


def _clone(tensors):
    return [t.detach().clone() for t in tensors]


def _main_params(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def _adam_state(optimizer):
    return [v.clone() for p in _main_params(optimizer)
            for v in optimizer.optimizer.state.get(p, {}).values()]


def _bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _torch_reference(opt, steps, clip_grad=0.0):
    """The same model, batches and param groups with plain torch (fused, as the wrapper)."""
    model = _llama()
    groups = [{**g, "weight_decay": opt["weight_decay"] * g["wd_mult"]}
              for g in get_param_groups([model])]
    if opt["optimizer"] == "adam":
        torch_opt = torch.optim.AdamW(groups, lr=opt["lr"], eps=1e-8, fused=True,
                                      betas=(opt["adam_beta1"], opt["adam_beta2"]))
    else:
        torch_opt = torch.optim.SGD(groups, lr=opt["lr"], momentum=opt["sgd_momentum"],
                                    fused=True)
    norms = []
    for tokens, labels in _batches(steps):
        torch_opt.zero_grad(set_to_none=True)
        model(tokens, labels=labels).float().mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                    clip_grad or math.inf).item())
        torch_opt.step()
    return model, norms


# --- 1. the scalers, pure ---------------------------------------------------------------------

def test_dynamic_grad_scaler_hysteresis_growth_and_floor():
    s = DynamicGradScaler(2.0 ** 10, min_scale=2.0 ** 8, growth_interval=3, hysteresis=2)

    def update(*found_infs):
        for found_inf in found_infs:
            s.update(found_inf)
        return s.scale, s.growth_tracker, s.hysteresis_tracker

    assert update(True) == (2.0 ** 10, 0, 1)  # first inf: kept
    assert update(True)[0] == 2.0 ** 9  # second inf: halved
    assert update(True, True)[0] == 2.0 ** 8  # never below min_scale
    assert update(False, False, True, False, False)[:2] == (2.0 ** 8, 2)  # inf resets growth
    assert update(False) == (2.0 ** 9, 0, 2)  # 3 clean in a row: doubled, hysteresis reset
    state = s.state_dict()
    t = DynamicGradScaler(1.0, 1.0, growth_interval=3, hysteresis=2)
    t.load_state_dict(state)
    assert t.state_dict() == state == {"scale": 2.0 ** 9, "growth_tracker": 0,
                                       "hysteresis_tracker": 2}
    c = ConstantGradScaler(128.0)
    for found_inf in (True, True, True, False):
        c.update(found_inf)
    assert (c.scale, c.inv_scale) == (128.0, 1.0 / 128)
    c2 = ConstantGradScaler(1.0)
    c2.load_state_dict(c.state_dict())
    assert c2.scale == 128.0


# --- 2. fp16 dynamic loss scaling, end to end ---------------------------------------------------

FP16 = dict(initial_loss_scale=2.0 ** 10, hysteresis=2, loss_scale_window=3, clip_grad=0.0,
            **ADAM)


def _fp16_skips_and_scale():
    model, opt = _build(torch.float16, **FP16)
    batches = _batches(7)
    assert _train(model, opt, batches[:1])[0][0]  # a clean step: Adam state exists
    scales = []
    for i in (1, 2):  # two overflowing steps
        _forward_backward(model, opt, batches[i], inject_inf=True)
        before = (_clone(model.parameters()), _clone(_main_params(opt)), _adam_state(opt))
        assert opt.step() == (False, None, None)
        after = (_clone(model.parameters()), _clone(_main_params(opt)), _adam_state(opt))
        assert all(_bitwise(b, a) for b, a in zip(before, after))
        assert opt.num_skipped_steps == i
        scales.append(opt.get_loss_scale())
    for batch in batches[3:6]:  # loss_scale_window clean steps
        (ok, norm, _), = _train(model, opt, [batch])
        assert ok and math.isfinite(norm)
        scales.append(opt.get_loss_scale())
    assert opt.optimizer.state[_main_params(opt)[0]]["step"].item() == 4
    return scales


def test_fp16_overflow_skips_step_and_scale_follows_hysteresis_and_window():
    scales = run_distributed(_fp16_skips_and_scale, world_size=1, tp=1)[0]
    assert scales == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10]


def _fp16_unscaled_grads(loss_scale):
    model, opt = _build(torch.float16, **{**FP16, "loss_scale": loss_scale})
    assert _train(model, opt, _batches(1))[0][0]
    return [p.grad.clone() for p in _main_params(opt)]  # what the optimizer stepped with


FP16_GRAD_REL_TOL = 4e-3


def test_fp16_loss_scale_is_divided_out_of_main_grads():
    scaled = run_distributed(_fp16_unscaled_grads, world_size=1, tp=1, loss_scale=None)[0]
    plain = run_distributed(_fp16_unscaled_grads, world_size=1, tp=1, loss_scale=1.0)[0]
    # Not bitwise: the unscaled run's activation gradients (~1e-5) fall into fp16's subnormal
    # range (< 6.1e-5) and lose digits; that is what scaling is for. Measured per-tensor
    # |scaled - plain| / |plain| <= 1.3e-3 (fp16 eps 9.8e-4); the bound is 3x that. A scale left
    # in, or divided out twice, would be off by a factor 1024.
    for s, p in zip(scaled, plain):
        assert s.dtype == torch.float32
        assert ((s - p).norm() / p.norm()).item() < FP16_GRAD_REL_TOL


# --- 3. bf16: fp32 main params are what the optimizer updates -------------------------------------

def _bf16_master_weights():
    model, opt = _build(torch.bfloat16, optimizer="sgd", lr=1e-3, sgd_momentum=0.0,
                        weight_decay=0.0, clip_grad=0.0)
    pairs = [(m, p) for g, mg in zip(get_param_groups([model]), opt.param_groups)
             for m, p in zip(g["params"], mg["params"])]
    for model_p, main_p in pairs:
        assert model_p.dtype == torch.bfloat16 and main_p.dtype == torch.float32
        assert main_p is not model_p and main_p.data_ptr() != model_p.data_ptr()
        assert torch.equal(main_p, model_p.float())
    # Norm weights are 1.0, where bf16's spacing is 2^-7: updates of 1e-3 round away until
    # 1 + k*1e-3 passes the half-way point 1 + 2^-8, i.e. at k = 4.
    norms = [(m, p) for m, p in pairs if m.dim() == 1 and bool((m == 1).all())]
    assert len(norms) >= 5
    for k in range(1, 5):
        model.zero_grad_buffer()
        for model_p, _ in norms:
            model_p.main_grad.fill_(-1.0)
        assert opt.step()[0]
        for model_p, main_p in norms:
            torch.testing.assert_close(main_p, torch.full_like(main_p, 1 + k * 1e-3),
                                       rtol=0, atol=1e-6)
            assert bool((model_p == (1.0 if k < 4 else 1.0 + 2 ** -7)).all()), k
    _train(model, opt, _batches(1))  # a real step: model params = main params rounded
    for model_p, main_p in pairs:
        assert torch.equal(model_p, main_p.to(torch.bfloat16))


def test_bf16_main_params_are_fp32_copies_and_accumulate_small_updates():
    run_distributed(_bf16_master_weights, world_size=1, tp=1)


def _losses(dtype, steps):
    model, opt = _build(dtype, clip_grad=1.0, **{**ADAM, "lr": 3e-3})
    losses = []
    for batch in _batches(1) * steps:  # one batch, memorised: the loss really moves
        losses.append(_forward_backward(model, opt, batch))
        assert opt.step()[0]
    return losses


# bf16 rounds every activation and weight at ~2^-9 relative (8-bit mantissa); the fp32 main
# params keep the trajectories together. Observed max |loss diff| over 20 steps (loss 4.18 ->
# 2.10): 2.5e-3 (rel 1.2e-3). The bound is ~2.8x that.
BF16_LOSS_TOL = 7e-3


def test_bf16_training_tracks_fp32():
    fp32 = run_distributed(_losses, world_size=1, tp=1, dtype=torch.float32, steps=20)[0]
    bf16 = run_distributed(_losses, world_size=1, tp=1, dtype=torch.bfloat16, steps=20)[0]
    diff = max(abs(a - b) for a, b in zip(fp32, bf16))
    print(f"bf16 vs fp32 max |loss diff| over 20 steps: {diff:.3g}")
    assert diff < BF16_LOSS_TOL
    assert fp32[-1] < fp32[0] - 1.0 and bf16[-1] < bf16[0] - 1.0  # it did train


# --- 4. param groups ---------------------------------------------------------------------------

def _gpt_param_groups():
    model = GPTModel(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                       max_position_embeddings=SEQ), VOCAB)
    groups = get_param_groups([model])
    opt = get_megatron_optimizer(OptimizerConfig(weight_decay=0.1), [model])
    by_id = {id(p): g["wd_mult"] for g in groups for p in g["params"]}
    assert len(by_id) == len(list(model.parameters()))  # each param in exactly one group
    names = {}
    for name, p in model.named_parameters():
        names[name] = by_id[id(p)]
        assert by_id[id(p)] == (0.0 if name.endswith(".bias") or p.dim() == 1 else 1.0), name
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1 * g["wd_mult"] for g in groups]
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in groups]
    return names


def test_param_groups_exclude_biases_and_norms_from_weight_decay():
    names = run_distributed(_gpt_param_groups, world_size=1, tp=1)[0]
    assert sum(n.endswith(".bias") for n in names) == 13  # 6 per layer + the final norm
    for name, wd_mult in names.items():  # by name here, by shape in the code under test
        no_decay = "layernorm" in name or name.endswith(".bias")
        assert wd_mult == (0.0 if no_decay else 1.0), name
    assert names["embedding.position_embeddings.weight"] == 1.0


# --- 5/6. FP32 optimizer = plain torch; clipping -----------------------------------------------

def _fp32_vs_torch(opt, ddp, clip_grad, steps=3):
    model, optimizer = _build(ddp=ddp, clip_grad=clip_grad, **opt)
    norms = [r[1] for r in _train(model, optimizer, _batches(steps))]
    ref, ref_norms = _torch_reference(opt, steps, clip_grad)
    got, want = _clone(model.parameters()), _clone(ref.parameters())
    if clip_grad == 0:
        assert _bitwise(got, want)
        return
    # Norm: _foreach_norm squared and summed vs torch's norm of the per-tensor norms (another
    # summation order): rel 1e-6 (measured 8e-8). It reaches grads and params only through the
    # clip coefficient: 1e-6 absolute (measured 4e-9).
    for a, b in zip(norms, ref_norms):
        assert a > clip_grad and abs(a - b) <= 1e-6 * b
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for p, r in zip(model.parameters(), ref.parameters()):  # last step's clipped grads
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("opt", [ADAM, SGD], ids=["adamw", "sgd"])
@pytest.mark.parametrize("ddp", [False, True], ids=["grad", "main_grad"])
def test_fp32_optimizer_is_bitwise_torch(opt, ddp):
    run_distributed(_fp32_vs_torch, world_size=1, tp=1, opt=opt, ddp=ddp, clip_grad=0.0)


def test_clip_grad_matches_torch_clip_grad_norm():
    sgd = {**SGD, "sgd_momentum": 0.0}  # SGD, not Adam: Adam would normalise the clip away
    run_distributed(_fp32_vs_torch, world_size=1, tp=1, opt=sgd, ddp=False, clip_grad=0.5,
                    steps=2)


# --- 7. checkpoints ---------------------------------------------------------------------------

def _resume(dtype, inf_at):
    kw = dict(**ADAM, clip_grad=1.0)
    if dtype == torch.float16:
        kw.update(initial_loss_scale=2.0 ** 10, hysteresis=2, loss_scale_window=3)
    batches = _batches(4)
    model, opt = _build(dtype, **kw)
    _train(model, opt, batches, inf_at)
    straight = (_clone(model.parameters()), _clone(_main_params(opt)), opt.state_dict())

    model, opt = _build(dtype, **kw)
    _train(model, opt, batches[:2], inf_at)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = _build(dtype, seed=7, **kw)  # other init: everything must come from ckpt
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    assert opt.num_skipped_steps == len(inf_at)
    if opt.grad_scaler is not None:
        assert opt.grad_scaler.state_dict() == ckpt["optimizer"]["grad_scaler"]
    _train(model, opt, batches[2:], [i - 2 for i in inf_at])
    resumed = (_clone(model.parameters()), _clone(_main_params(opt)), opt.state_dict())
    assert _bitwise(straight[0], resumed[0]) and _bitwise(straight[1], resumed[1])
    assert straight[2].get("grad_scaler") == resumed[2].get("grad_scaler")
    assert straight[2]["num_skipped_steps"] == resumed[2]["num_skipped_steps"]
    return straight[2].get("grad_scaler")


@pytest.mark.parametrize("dtype,inf_at", [(torch.float32, ()), (torch.bfloat16, ()),
                                          (torch.float16, (0,))], ids=["fp32", "bf16", "fp16"])
def test_checkpoint_round_trip_resumes_bitwise(dtype, inf_at):
    scaler = run_distributed(_resume, world_size=1, tp=1, dtype=dtype, inf_at=inf_at)[0]
    if dtype == torch.float16:  # a skip (hysteresis 2 -> 1) then 3 clean steps: doubled
        assert scaler == {"scale": 2.0 ** 11, "growth_tracker": 0, "hysteresis_tracker": 2}


# --- 8. config validation ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,flag", [
    (dict(fp16=True, bf16=True), "--fp16 and --bf16"),
    (dict(optimizer="lamb"), "--optimizer"),
    (dict(clip_grad=-1.0), "--clip-grad"),
    (dict(hysteresis=0), "--hysteresis"),
    (dict(loss_scale_window=0), "--loss-scale-window"),
    (dict(min_loss_scale=2.0 ** 20, initial_loss_scale=2.0 ** 10), "--min-loss-scale"),
])
def test_optimizer_config_rejects_bad_values(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        OptimizerConfig(**kwargs)
