"""--use-torch-fsdp2 checkpoints through the sharded format, in process (gloo, fp32).

A run trains 3 steps, saves, and trains a 4th; another run (another layout) loads the save:
- the state it holds after loading (weights, Adam's exp_avg / exp_avg_sq, step), gathered
  whole, equals the saved run's BITWISE: loading only copies bytes, whatever the layout
  (FSDP2 at DP=2 and 4, ZeRO-2 and 3; the distributed optimizer at DP=4; one process);
- its 4th step equals the saved run's 4th step: bitwise at the same layout (the same
  arithmetic), within REASSOCIATION_TOL (1e-6, the DDP tests' bound) at another (the
  gradient sums are ordered differently).
The same for the reverse: the distributed optimizer at DP=4 saves, FSDP2 at DP=2 loads.
"""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed.fsdp import TorchFSDP2Config
from megatron.core.models import LlamaModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.checkpointing import load_checkpoint
from megatron.training.checkpointing.writer import CheckpointWriter
from megatron.training.training import build_model, train_step
from megatron.training.training_config import MegatronConfigs, TrainingConfig
from tests.distributed import run_distributed
from tests.unit.test_checkpoint_save import _save, _scheduler
from tests.unit.test_data_parallel import (
    ADAM,
    MBS,
    REASSOCIATION_TOL,
    SEQ,
    VOCAB,
    _assert_params,
    _config,
    _forward_step,
    _global_batches,
)
from tests.unit.test_distributed_optimizer import _build, _train

BATCHES = _global_batches(4, steps=4)  # 4 microbatches per step


def _build_layout(kind):
    """(model, optimizer, configs' optimizer config) of ``kind``: "zero3"/"zero2" (FSDP2),
    "distributed" or "none" (plain DDP)."""
    if kind in ("zero3", "zero2"):
        config = _config()
        model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                            TorchFSDP2Config(reshard_after_forward=kind == "zero3"), seed=42)
        opt_config = OptimizerConfig(clip_grad=0.0, **ADAM)
        return model[0], get_megatron_optimizer(opt_config, model), opt_config
    model, optimizer = _build(kind)
    return model, optimizer, optimizer.config


def _step(model, optimizer, kind, batches):
    if kind not in ("zero3", "zero2"):
        _train(model, optimizer, batches)
        return
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    for batch in batches:
        local = len(batch) // dp
        mine = batch[rank * local:(rank + 1) * local]
        _, skipped, _, _ = train_step(_forward_step, iter(mine), [model], optimizer, None,
                                      local, SEQ, MBS)
        assert not skipped


def _whole_state(model, optimizer, kind):
    """(weights, {param name: {key: tensor}}, step), gathered whole (every rank calls it;
    the result kept on rank 0)."""
    if kind in ("zero3", "zero2"):
        weights = {n: p.full_tensor().clone() for n, p in model.module.named_parameters()}
        state, step = {}, None
        for param, values in optimizer.optimizer.state.items():
            step = float(values["step"])
            state[optimizer._names[param]] = {k: v.full_tensor().clone()
                                              for k, v in values.items() if k != "step"}
        return weights, state, step
    weights = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    saved = optimizer.state_dict()  # gathered on DP rank 0
    if saved is None:
        return weights, None, None
    return weights, {n: {k: v.clone() for k, v in e.items()}
                     for n, e in saved["params"].items()}, saved["step"]


def _configs(model, opt_config, **training):
    return MegatronConfigs(transformer=model.config, optimizer=opt_config,
                           ddp=model.ddp_config, scheduler_kwargs={}, dataset=None,
                           training=TrainingConfig(ckpt_format="torch_dist", **training))


def _save_after_3_steps(tmp_path, kind):
    model, optimizer, opt_config = _build_layout(kind)
    scheduler = _scheduler(optimizer)
    _step(model, optimizer, kind, BATCHES[:3])
    configs = _configs(model, opt_config, save=str(tmp_path))
    _save(tmp_path, 3, model, optimizer, scheduler, configs, CheckpointWriter())
    saved = _whole_state(model, optimizer, kind)
    _step(model, optimizer, kind, BATCHES[3:])
    return saved, _whole_state(model, optimizer, kind)[0]


def _load_and_step(tmp_path, kind):
    model, optimizer, opt_config = _build_layout(kind)
    configs = _configs(model, opt_config, load=str(tmp_path))
    loaded = load_checkpoint([model], optimizer, _scheduler(optimizer), configs)
    assert loaded.iteration == 3
    state = _whole_state(model, optimizer, kind)
    _step(model, optimizer, kind, BATCHES[3:])
    return state, _whole_state(model, optimizer, kind)[0]


def _assert_same_state(got, want):
    (weights, state, step), (want_weights, want_state, want_step) = got, want
    _assert_params(weights, want_weights, 0)
    assert step == want_step == 3.0
    assert state.keys() == want_state.keys()
    for name, values in want_state.items():
        assert sorted(state[name]) == sorted(values) == ["exp_avg", "exp_avg_sq"], name
        for key, value in values.items():
            assert torch.equal(state[name][key], value), (name, key)


def _save_then_load(tmp_path, saved_kind, saved_dp, kind, dp):
    saved, fourth = run_distributed(_save_after_3_steps, world_size=saved_dp, tp=1,
                                    tmp_path=tmp_path, kind=saved_kind)[0]
    loaded, resumed_fourth = run_distributed(_load_and_step, world_size=dp, tp=1,
                                             tmp_path=tmp_path, kind=kind)[0]
    _assert_same_state(loaded, saved)
    same_layout = (saved_kind, saved_dp) == (kind, dp)
    _assert_params(resumed_fourth, fourth, 0 if same_layout else REASSOCIATION_TOL)


@pytest.mark.parametrize("mode", ["zero3", "zero2"])
def test_fsdp2_dp2_resumes_bitwise(tmp_path, mode):
    _save_then_load(tmp_path, mode, 2, mode, 2)


@pytest.mark.parametrize("kind,dp", [("zero2", 4), ("distributed", 4), ("none", 1)],
                         ids=["fsdp2-zero2-dp4", "distributed-dp4", "one-process"])
def test_fsdp2_save_loads_into_another_layout(tmp_path, kind, dp):
    _save_then_load(tmp_path, "zero3", 2, kind, dp)


def test_distributed_optimizer_save_loads_into_fsdp2(tmp_path):
    _save_then_load(tmp_path, "distributed", 4, "zero3", 2)
