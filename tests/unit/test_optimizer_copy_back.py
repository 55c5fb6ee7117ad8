"""The copy of the fp32 main params back to the bf16 model params after the step is one
``torch._foreach_copy_`` (one launch on CUDA, not one per tensor): bitwise the per-tensor loop."""
import torch

from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    copy_main_to_model,
    fp32_main_param_groups,
)

SHAPES = [(7, 5), (33,), (4, 3, 2), (1,), (128, 9)]


def _fp32_mains(seed=0):
    """Values that round every way to bf16: random, halfway ties, subnormals, inf, nan."""
    g = torch.Generator().manual_seed(seed)
    mains = [torch.randn(shape, generator=g) * 10.0 ** torch.randint(-30, 30, (1,), generator=g)
             for shape in SHAPES]
    ties = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8), 1e-40,
                         -1e-41, float("inf"), float("-inf"), float("nan"), 3.4e38])
    mains[1][:len(ties)] = ties
    return mains


def _bits(tensors):
    return [t.view(torch.int16).clone() for t in tensors]


def test_foreach_copy_is_bitwise_the_loop_of_copies():
    mains = _fp32_mains()
    by_loop = [torch.empty(m.shape, dtype=torch.bfloat16) for m in mains]
    for model, main in zip(by_loop, mains):
        model.copy_(main)
    by_foreach = [torch.zeros(m.shape, dtype=torch.bfloat16) for m in mains]
    copy_main_to_model(list(zip(mains, by_foreach)))
    assert all(torch.equal(a, b) for a, b in zip(_bits(by_loop), _bits(by_foreach)))


def test_float16_optimizer_copies_every_main_param_back_bitwise():
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)) for shape in SHAPES]
    fp32 = torch.nn.Parameter(torch.zeros(3))  # an fp32 model param is its own main param
    groups, model_of = fp32_main_param_groups([{"params": params + [fp32]}])
    optimizer = Float16OptimizerWithFloat16Params(torch.optim.SGD(groups, lr=0.1), None, None,
                                                  model_of)
    mains = [m for m in groups[0]["params"] if m is not fp32]
    with torch.no_grad():
        for main, values in zip(mains, _fp32_mains(seed=1)):
            main.copy_(values)
        fp32.copy_(torch.tensor([1.0, 2.0, 3.0]))
    optimizer._copy_main_params_to_model_params()
    want = [main.detach().to(torch.bfloat16) for main in mains]
    assert all(torch.equal(a, b) for a, b in zip(_bits(want), _bits(params)))
    assert torch.equal(fp32, torch.tensor([1.0, 2.0, 3.0]))
