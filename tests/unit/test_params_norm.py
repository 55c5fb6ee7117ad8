"""--log-params-norm's number (MegatronOptimizer.params_norm): the L2 norm of the model's main
parameters, every element once, whatever the layout. Initial weights do not depend on the
layout, so before any step each layout's norm is the one-process model's (torch's norm of
all its parameters) up to the order of fp32 sums; after three steps too, within the layouts'
own drift (tests/unit/test_data_parallel.py's REASSOCIATION_TOL on each weight)."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp import TorchFSDP2Config
from megatron.core.models import LlamaModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.training import build_model, train_step
from tests.distributed import run_distributed
from tests.unit.test_data_parallel import (
    ADAM,
    MBS,
    SEQ,
    VOCAB,
    _config,
    _forward_step,
    _global_batches,
)

SUM_ORDER = 1e-6  # relative: fp32 sums of squares in another order
STEPS, MICROBATCHES = 3, 4


def _norms(kind, tensor, pipeline):
    tp, pp = tensor, pipeline
    ps.initialize_model_parallel(tp, pp)
    config = _config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                     pipeline_model_parallel_size=pp)
    sharded = kind == "distributed"
    ddp = TorchFSDP2Config() if kind == "fsdp2" else \
        DistributedDataParallelConfig(use_distributed_optimizer=sharded)
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config, ddp,
                        seed=42)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        clip_grad=0.0, use_distributed_optimizer=sharded, **ADAM), model)
    norms = [optimizer.params_norm().item()]
    whole = None
    if torch.distributed.get_world_size() == 1:  # the reference: torch's norm of every parameter
        whole = torch.linalg.vector_norm(torch.cat(
            [p.detach().reshape(-1) for p in model[0].parameters()])).item()
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = MICROBATCHES // dp
    for batch in _global_batches(MICROBATCHES, STEPS):
        train_step(_forward_step, iter(batch[rank * local:][:local]), model, optimizer, None,
                   local, SEQ, MBS)
    norms.append(optimizer.params_norm().item())
    return norms, whole


# the other layouts in the full suite only (the quick tier's time)
@pytest.mark.parametrize("kind,tp,pp", [
    ("distributed", 2, 1), *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("plain", 2, 1), ("fsdp2", 2, 1), ("distributed", 1, 2)))])
def test_every_layout_gives_the_one_process_norm(kind, tp, pp):
    (reference, whole), = run_distributed(_norms, world_size=1, kind="plain", tensor=1,
                                         pipeline=1)
    assert reference[0] == pytest.approx(whole, rel=SUM_ORDER)
    assert reference[1] != reference[0]  # the steps moved the weights
    for norms, _ in run_distributed(_norms, world_size=4, kind=kind, tensor=tp, pipeline=pp):
        for got, want in zip(norms, reference, strict=True):
            assert got == pytest.approx(want, rel=SUM_ORDER)
