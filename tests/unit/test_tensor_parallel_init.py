"""A model starts from the same full weights whatever its TP size: each rank's shard is a
slice of one master weight drawn from the same seed."""
import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.utils import init_method_normal
from tests.distributed import run_distributed


def _shards():
    """This rank's initial shards for each layer kind, built after the same seed."""
    config = ModelParallelConfig()
    init = init_method_normal(0.02)
    torch.manual_seed(99)
    column = ColumnParallelLinear(12, 16, config=config, init_method=init)
    gated = ColumnParallelLinear(12, 16, config=config, init_method=init, stride=2)
    row = RowParallelLinear(16, 12, config=config, init_method=init)
    embedding = VocabParallelEmbedding(32, 12, config=config, init_method=init)
    return {"column": column.weight.detach(), "gated": gated.weight.detach(),
            "row": row.weight.detach(), "embedding": embedding.weight.detach()}


def _expected_shard(full, kind, tp, rank):
    if kind == "row":
        return full.chunk(tp, dim=1)[rank]
    if kind == "gated":
        # stride 2 on [gate; up]: rank r holds gate block r then up block r.
        blocks = full.split(full.shape[0] // (2 * tp), dim=0)
        return torch.cat([blocks[rank], blocks[tp + rank]], dim=0)
    return full.chunk(tp, dim=0)[rank]


def test_initial_weights_do_not_depend_on_tp_size():
    (full,) = run_distributed(_shards, world_size=1, tp=1)
    for tp in (2, 4):
        shards = run_distributed(_shards, world_size=tp, tp=tp)
        for kind, weight in full.items():
            for rank, got in enumerate(shards):
                assert torch.equal(got[kind], _expected_shard(weight, kind, tp, rank)), \
                    f"{kind} shard of TP rank {rank}/{tp} is not the slice of the TP=1 weight"
    # Not trivially equal: the weight is really random and the two layers differ.
    assert full["column"].std() > 0.01 and not torch.equal(full["column"], full["gated"])


def _skip_initialisation():
    config = ModelParallelConfig(perform_initialization=False)
    layer = ColumnParallelLinear(4, 4, config=config, init_method=init_method_normal(0.02))
    return layer.weight.shape, getattr(layer.weight, "tensor_model_parallel"), \
        getattr(layer.weight, "partition_dim")


def test_tensor_parallel_attributes_are_set():
    assert run_distributed(_skip_initialisation, world_size=2, tp=2) == \
        [(torch.Size([2, 4]), True, 0)] * 2


def _bad_shapes():
    config = ModelParallelConfig()
    init = init_method_normal(0.02)
    messages = []
    for build in (lambda: VocabParallelEmbedding(13, 4, config=config, init_method=init),
                  lambda: ColumnParallelLinear(4, 6, config=config, init_method=init),
                  lambda: RowParallelLinear(6, 4, config=config, init_method=init),
                  lambda: RowParallelLinear(8, 4, config=ModelParallelConfig(
                      sequence_parallel=True), init_method=init, input_is_parallel=False)):
        with pytest.raises(ValueError) as info:
            build()
        messages.append(str(info.value))
    layer = ColumnParallelLinear(4, 8, config=config, init_method=init)
    with pytest.raises(ValueError, match="weight of shape"):
        layer(torch.randn(2, 4), weight=torch.randn(8, 4))
    return messages


def test_clear_errors_on_bad_shapes():
    messages = run_distributed(_bad_shapes, world_size=4, tp=4)[0]
    assert "vocabulary of 13 rows is not divisible by tensor-model-parallel size 4" in messages[0]
    assert "vocab_size_with_padding" in messages[0]
    assert "6 is not divisible by 4 (ColumnParallelLinear output size" in messages[1]
    assert "6 is not divisible by 4 (RowParallelLinear input size" in messages[2]
    assert "input_is_parallel=True" in messages[3]
