"""--optimizer-cpu-offload against the same optimizer without it.

On this CPU-only machine the "device" is the CPU too, so what is checked is that the offloaded
optimizer keeps its own host copies (main params, gradients, state share no storage with the
model's params or DDP buffers) and that the step's arithmetic is the same: both sides run
torch's fused CPU AdamW on fp32 main params and grads, unscale / check / clip with the same
kernels, so losses, params, main params, Adam state and grad norms are compared bitwise.
(On CUDA the offloaded norm and step run on the CPU, the plain ones on the GPU: not bitwise.)
"""
import io

import pytest
import torch

from megatron.core.distributed import (
    DistributedDataParallel,
    ddp_config_for_optimizer,
    finalize_model_grads,
)
from megatron.core.models import LlamaModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.cpu_offload import (
    CpuOffloadDistributedOptimizer,
    CpuOffloadOptimizer,
)
from tests.distributed import run_distributed
from tests.unit.test_data_parallel import VOCAB, _config, _global_batches
from tests.unit.test_distributed_optimizer import _train as _train_sharded
from tests.unit.test_optimizer import ADAM, _batches, _build, _clone, _main_params, _train

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _options(dtype):
    kw = dict(**ADAM, clip_grad=0.05)  # small enough that every step is clipped
    if dtype == torch.float16:
        kw.update(initial_loss_scale=2.0 ** 10, hysteresis=1, loss_scale_window=3)
    return kw


def _state_tensors(optimizer):
    return [v for p in _main_params(optimizer)
            for v in optimizer.optimizer.state.get(p, {}).values() if v.dim() > 0]


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def _check_on_host(model, optimizer):
    """Main params, their grads and the Adam state are host tensors of their own: none shares
    storage with the model's params or the DDP gradient buffers (pinned on CUDA)."""
    host = _main_params(optimizer) + _state_tensors(optimizer)
    host += [p.grad for p in _main_params(optimizer) if p.grad is not None]
    model_side = list(model.parameters())
    model_side += [p.main_grad for p in model.parameters() if hasattr(p, "main_grad")]
    assert host and not _storages(host) & _storages(model_side)
    assert all(t.device.type == "cpu" for t in host)
    if next(model.parameters()).is_cuda:
        assert all(t.is_pinned() for t in host)


def _plain_run(dtype, offload, steps=4, inf_at=()):
    model, opt = _build(dtype, optimizer_cpu_offload=offload, **_options(dtype))
    assert isinstance(opt, CpuOffloadOptimizer) == offload
    results = _train(model, opt, _batches(steps), inf_at)
    if offload:
        _check_on_host(model, opt)
    return dict(results=results, params=_clone(model.parameters()),
                mains=_clone(_main_params(opt)), state=_clone(_state_tensors(opt)),
                checkpoint=opt.state_dict(), skipped=opt.num_skipped_steps)


def _assert_same_tensors(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _assert_same_named_state(a, b):
    assert a.keys() == b.keys() and a["params"].keys() == b["params"].keys()
    for name, entry in a["params"].items():
        assert entry.keys() == b["params"][name].keys(), name
        for key, value in entry.items():
            assert torch.equal(value, b["params"][name][key]), (name, key)
    assert {k: v for k, v in a.items() if k != "params"} == \
        {k: v for k, v in b.items() if k != "params"}


@pytest.mark.parametrize("name", DTYPES)
def test_plain_offload_steps_bitwise_as_without(name):
    dtype = DTYPES[name]
    inf_at = (1,) if dtype == torch.float16 else ()  # a skipped step on the fp16 side
    want, got = (run_distributed(_plain_run, world_size=1, tp=1, dtype=dtype, offload=o,
                                 inf_at=inf_at)[0] for o in (False, True))
    assert got["results"] == want["results"]  # (stepped, grad norm, zeros) per step
    assert got["skipped"] == want["skipped"] == len(inf_at)
    for key in ("params", "mains", "state"):
        _assert_same_tensors(got[key], want[key])
    _assert_same_named_state(got["checkpoint"], want["checkpoint"])


def _cross_resume(dtype, save_offloaded):
    """Save after 2 steps with one setting, resume with the other: the last 2 steps as
    without saving."""
    batches, kw = _batches(4), _options(dtype)
    model, opt = _build(dtype, **kw)
    _train(model, opt, batches)
    straight = _clone(model.parameters())
    model, opt = _build(dtype, optimizer_cpu_offload=save_offloaded, **kw)
    _train(model, opt, batches[:2])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = _build(dtype, seed=7, optimizer_cpu_offload=not save_offloaded, **kw)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    _train(model, opt, batches[2:])
    _assert_same_tensors(_clone(model.parameters()), straight)
    return True


@pytest.mark.parametrize("save_offloaded", [True, False], ids=["from_offload", "to_offload"])
@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_checkpoint_moves_between_offloaded_and_not(name, save_offloaded):
    assert run_distributed(_cross_resume, world_size=1, tp=1, dtype=DTYPES[name],
                           save_offloaded=save_offloaded)[0]


# --- the distributed optimizer at DP 2 --------------------------------------------------------

def _build_sharded(kind, offload, dtype, seed=42):
    config = _config(params_dtype=dtype)
    opt_config = OptimizerConfig(use_distributed_optimizer=kind == "distributed",
                                 overlapped_distributed_optimizer=kind == "overlapped",
                                 bf16=dtype == torch.bfloat16, optimizer_cpu_offload=offload,
                                 **{**ADAM, "clip_grad": 0.05})
    ddp_config = ddp_config_for_optimizer(opt_config, bucket_size=3000,
                                          reduce_bucket_size=3000)
    torch.manual_seed(seed)
    model = DistributedDataParallel(config, ddp_config, LlamaModel(config, VOCAB))
    config.finalize_model_grads_func = finalize_model_grads
    return model, get_megatron_optimizer(opt_config, [model])


def _sharded_run(kind, offload, dtype):
    model, opt = _build_sharded(kind, offload, dtype)
    assert isinstance(opt, CpuOffloadDistributedOptimizer) == offload
    history = _train_sharded(model, opt, _global_batches(2, steps=4))
    if offload:
        _check_on_host(model, opt)
    parts, meta = opt.sharded_state()
    parts = [(n, b, e, {k: v.clone() for k, v in values.items()}) for n, b, e, values in parts]
    return dict(history=history, state=opt.state_dict(), parts=parts, meta=meta,
                mains=_clone(_main_params(opt)), adam=_clone(_state_tensors(opt)))


@pytest.mark.parametrize("name", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["distributed", "overlapped"])
def test_sharded_offload_steps_bitwise_as_without(kind, name):
    dtype = DTYPES[name]
    want, got = (run_distributed(_sharded_run, world_size=2, tp=1, kind=kind, offload=o,
                                 dtype=dtype) for o in (False, True))
    for rank_want, rank_got in zip(want, got):
        for params_want, params_got in zip(rank_want["history"], rank_got["history"]):
            _assert_same_tensors(list(params_got.values()), list(params_want.values()))
        _assert_same_tensors(rank_got["mains"], rank_want["mains"])
        _assert_same_tensors(rank_got["adam"], rank_want["adam"])
        assert rank_got["meta"] == rank_want["meta"]
        assert [p[:3] for p in rank_got["parts"]] == [p[:3] for p in rank_want["parts"]]
        for (_, _, _, values_got), (_, _, _, values_want) in zip(rank_got["parts"],
                                                                rank_want["parts"]):
            assert values_got.keys() == values_want.keys()
            _assert_same_tensors(list(values_got.values()), list(values_want.values()))
    _assert_same_named_state(got[0]["state"], want[0]["state"])  # gathered on DP rank 0
    assert got[1]["state"] is None


def _sharded_cross_load(dtype):
    """The offloaded distributed optimizer's checkpoint loads into the plain one (the same
    named state back), and both go on to the same step."""
    model, opt = _build_sharded("distributed", True, dtype)
    batches = _global_batches(2, steps=3)
    _train_sharded(model, opt, batches[:2])
    boxed = [opt.state_dict()]
    torch.distributed.broadcast_object_list(boxed, src=0)
    other_model, other = _build_sharded("distributed", False, dtype, seed=7)
    other_model.module.load_state_dict(model.module.state_dict())
    other.load_state_dict(boxed[0])
    again = other.state_dict()
    if again is not None:
        _assert_same_named_state(again, boxed[0])
    history = _train_sharded(model, opt, batches[2:])
    other_history = _train_sharded(other_model, other, batches[2:])
    _assert_same_tensors(list(history[-1].values()), list(other_history[-1].values()))
    return True


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_sharded_offload_checkpoint_loads_into_plain_distributed(name):
    assert all(run_distributed(_sharded_cross_load, world_size=2, tp=1, dtype=DTYPES[name]))


def test_flag_maps_to_the_optimizer_config():
    from megatron.training.arguments import build_configs, parse_args
    from tests.unit.test_arguments import small
    assert not build_configs(parse_args(small())).optimizer.optimizer_cpu_offload
    configs = build_configs(parse_args(small("--optimizer-cpu-offload",
                                             "--use-distributed-optimizer")), world_size=2)
    assert configs.optimizer.optimizer_cpu_offload and configs.optimizer.sharded
