"""Megatron's optimizer wrappers around a torch optimizer.

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``:
1. gradients: the DDP buffers' ``main_grad`` become the optimizer params' ``.grad`` (for mixed
   precision: copied into the fp32 main params' gradients);
2. with a loss scaler: unscale, and skip the whole step (and count it) if any rank saw inf/nan;
3. clip by the global norm over all model-parallel ranks (``clip_grad``);
4. the torch optimizer steps; ``row_scales`` (QK-clip) rescale rows of the main params; mixed
   precision copies the fp32 main params back to the model (the distributed optimizer
   all-gathers them).
"""
import math
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import device, optimizer_instances, parallel_state
from megatron.core.fp8.linear import weights_changed
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    is_counted_in_norm,
)
from megatron.core.optimizer.named_state import (
    check_covers,
    check_numel,
    load_scaler_and_counters,
    load_torch_state,
    param_key,
    saved_like,
    state_keys,
    wrap_state,
)
from megatron.core.pipeline_parallel.model_chunks import unwrap_model


def _model_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


class MegatronOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, config, grad_scaler=None):
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = grad_scaler
        self.num_skipped_steps = 0

    # --- what subclasses provide ------------------------------------------------------------

    def _copy_model_grads_to_main_grads(self) -> None:
        raise NotImplementedError

    def _copy_main_params_to_model_params(self) -> None:
        pass

    # --- shared logic ---------------------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The schedules call this on the last stage's loss before backward."""
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss

    def zero_grad(self) -> None:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                param.grad = None

    def _main_params_and_grads(self) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(p, p.grad) for group in self.optimizer.param_groups
                for p in group["params"] if p.grad is not None]

    def _counted_in_norm(self, pairs):
        """The values of (main param, value) ``pairs`` that a global norm counts: every
        element of the model once."""
        if optimizer_instances.instance_rank() > 0:
            # HSDP (a sharded optimizer's, the only kind with instances): every instance
            # holds the same shards, instance 0's are counted
            return []
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        replicas = self._replica_ranks()
        return [value for param, value in pairs
                if is_counted_in_norm(self._model_param(param), tp_rank, replicas)]

    def _grads_for_norm(self) -> List[torch.Tensor]:
        return self._counted_in_norm(self._main_params_and_grads())

    def _local_value(self, main: torch.nn.Parameter) -> torch.Tensor:
        """The values of ``main`` this rank holds (FSDP2: its rows)."""
        return main.detach()

    def params_norm(self) -> torch.Tensor:
        """The L2 norm of the model's main (fp32) parameters, every element once, summed as
        the gradient norm is (--log-params-norm; Megatron's calc_params_l2_norm): a
        one-element device tensor, unread. Collective over the norm's group."""
        return get_grad_norm_fp32(self._counted_in_norm(
            (main, self._local_value(main)) for main in self._main_params()),
            self._reduction_group())

    def _replica_ranks(self):
        """(DP rank, expert-DP rank) when the reductions run over DP replicas, else None."""
        if self._reduction_group() is not None:
            return None
        return (parallel_state.get_data_parallel_rank(with_context_parallel=True),
                parallel_state.get_expert_data_parallel_rank())

    def _model_param(self, main_param: torch.nn.Parameter) -> torch.nn.Parameter:
        return main_param

    def _reduction_group(self):
        """Ranks whose gradients together make the model's: the model-parallel group (DP
        replicas hold the same reduced gradients); with routed experts every rank (None),
        since the EP ranks inside the DP group hold different experts."""
        if parallel_state.expert_parallel_is_initialized():
            return None
        return parallel_state.get_model_parallel_group()

    def _unscale_and_check_for_inf(self) -> bool:
        """Divide out the loss scale; True if any model-parallel rank's gradients overflowed."""
        grads = [grad for _, grad in self._main_params_and_grads()]
        found_inf = device.zeros(1, dtype=torch.float32)
        inv_scale = device.tensor([self.grad_scaler.inv_scale], dtype=torch.float32)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self._reduction_group())
        return found_inf.item() > 0

    def clip_grad_norm(self, clip_grad: float) -> torch.Tensor:
        """The global gradient norm (a device tensor, unread), after clipping by it."""
        grad_norm = get_grad_norm_fp32(self._grads_for_norm(), self._reduction_group())
        if clip_grad > 0:
            clip_grad_by_total_norm_fp32([g for _, g in self._main_params_and_grads()],
                                         clip_grad, grad_norm)
        return grad_norm

    @torch.no_grad()
    def step(self, read_with_norm=None, row_scales=None
             ) -> Tuple[bool, Optional[Union[float, torch.Tensor]], Optional[int]]:
        """The grad norm comes back as a float where the NaN check read it, else as a device
        tensor (read it when needed: on CUDA each read waits for the GPU). ``read_with_norm``
        (``pending()`` -> tensor or None, ``resolve(floats)``: the iteration's losses) is read
        in the same host copy as the norm when the check reads it. ``row_scales`` ({model
        param: [rows] factors}, QK-clip's) multiply the updated main params' rows before they
        reach the model, only when the step is taken."""
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check_for_inf()
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.num_skipped_steps += 1
                return False, None, None
        grad_norm = self.clip_grad_norm(self.config.clip_grad)
        if self.config.check_for_nan_in_grad:
            grad_norm = _read_norm(grad_norm, read_with_norm)  # the host decides the skip
            if not math.isfinite(grad_norm):
                return False, grad_norm, None  # the norm is global: every rank skips alike
        num_zeros = count_zeros_fp32(self._grads_for_norm(), self._reduction_group()) \
            if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        if row_scales:
            self._scale_main_rows(row_scales)
        weights_changed()  # FP8's quantized weights are of the old ones (before any new one)
        self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros

    def _main_ranges(self):
        """(main values flat, model param, first and end element of the flattened model param
        they hold): every main param whole here; the distributed optimizer's are pieces."""
        return [(main.data.view(-1), self._model_param(main), 0, main.numel())
                for main in self._main_params()]

    def _scale_main_rows(self, row_scales: Dict[torch.nn.Parameter, torch.Tensor]) -> None:
        """Each main value times the factor of its model param's row (dim 0), in fp32 where
        the main params are (the copy back to the model then rounds once, as after any
        step)."""
        for flat, model, begin, end in self._main_ranges():
            factors = row_scales.get(model)
            if factors is not None:
                scale_rows_of_range_(flat, begin, end, model.numel() // model.shape[0],
                                     factors.to(flat.device, flat.dtype))

    # --- checkpoints (format: named_state.py) ------------------------------------------------
    def set_param_names(self, model_chunks: List[torch.nn.Module]) -> None:
        """Name each model parameter "{chunk}/{name}" for the checkpoint format."""
        self._names = {p: param_key(c, name) for c, chunk in enumerate(model_chunks)
                       for name, p in unwrap_model(chunk).named_parameters()}

    def _main_params(self) -> List[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def reload_model_params(self) -> None:
        """Main params from the model's (after loading model weights without optimizer)."""
        for main in self._main_params():
            model = self._model_param(main)
            if main is not model:
                main.data.copy_(model.data)
        weights_changed()

    def state_dict(self) -> Dict:
        """As torch's: host tensors that are the live state on CPU (copy before training on if
        the dict must stay a snapshot)."""
        keys = state_keys(self.optimizer, lambda p, v: v.shape == p.shape)
        params = {}
        for main in self._main_params():
            model = self._model_param(main)
            entry = {} if main is model else {"param": main.detach().to("cpu")}
            state = self.optimizer.state.get(main, {})
            entry.update({k: state[k].detach().to("cpu") for k in keys if k in state})
            params[self._names[model]] = entry
        step = last_step_tensor(self.optimizer, self._main_params())
        return wrap_state(self.optimizer, params, None if step is None else float(step), keys,
                          self.num_skipped_steps, self.grad_scaler)

    def sharded_state(self):
        """The named state as parts (see DistributedOptimizer.sharded_state): here every
        parameter whole, the same on every DP rank."""
        state = self.state_dict()
        parts = [(name, 0, next(iter(entry.values())).numel() if entry else 0,
                  {k: v.reshape(-1) for k, v in entry.items()})
                 for name, entry in state.pop("params").items()]
        return parts, state

    def load_state_dict(self, state: Dict) -> None:
        mains = self._main_params()
        check_covers(state, [self._names[self._model_param(m)] for m in mains])
        per_param = {}
        with torch.no_grad():
            for main in mains:
                model = self._model_param(main)
                key = self._names[model]
                saved = state["params"][key]
                if "param" in saved:
                    check_numel(key, saved["param"], main)
                    main.copy_(saved_like(saved["param"], main))
                elif main is not model:
                    main.copy_(model)
                if state["step"] is not None:
                    per_param[main] = {"step": torch.tensor(state["step"]), **{
                        k: saved_like(saved[k], main).to(main.device, copy=True)
                        for k in state["state_keys"] if k in saved}}
        load_torch_state(self.optimizer, per_param, state["param_groups"])
        load_scaler_and_counters(self, state)
        self._copy_main_params_to_model_params()


def scale_rows_of_range_(flat: torch.Tensor, begin: int, end: int, per_row: int,
                         factors: torch.Tensor) -> None:
    """``flat`` holds elements [begin, end) of a row-major tensor of ``per_row`` elements per
    row: multiply each by its row's factor, a partial first row, whole rows, a partial last
    row (no index tensor the size of the piece)."""
    pos = begin
    while pos < end:
        row = pos // per_row
        whole = (end - pos) // per_row if pos % per_row == 0 else 0
        if whole:
            count = whole * per_row
            flat[pos - begin:pos - begin + count].view(whole, per_row).mul_(
                factors[row:row + whole, None])
        else:
            count = min(end, (row + 1) * per_row) - pos
            flat[pos - begin:pos - begin + count].mul_(factors[row])
        pos += count


def _read_norm(grad_norm: torch.Tensor, read_with_norm) -> float:
    """The norm as a float, and ``read_with_norm``'s values with it: one host sync for both."""
    along = read_with_norm.pending() if read_with_norm is not None else None
    if along is None:
        return grad_norm.item()
    (norm,), values = device.read_together([grad_norm, along])
    read_with_norm.resolve(values)
    return norm


def last_step_tensor(optimizer: torch.optim.Optimizer,
                     params: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The step tensor of the last of ``params`` that has one (the checkpoint's step), unread:
    a save reads it once, not once per parameter."""
    for param in reversed(params):
        state = optimizer.state.get(param, {})
        if "step" in state:
            return state["step"]
    return None


class FP32Optimizer(MegatronOptimizer):
    """Model params are fp32 and are the optimizer's params."""

    def _copy_model_grads_to_main_grads(self) -> None:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                grad = getattr(param, "main_grad", None)
                if grad is not None:
                    param.grad = grad  # a view into the DDP buffer: no copy


_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride",
                   "shared_embedding", "sequence_parallel")


def main_param_like(data: torch.Tensor, param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A main param holding ``data`` with ``param``'s parallel attributes (TP partitioning,
    sequence parallel, shared embedding), which clipping and the checkpoint names read."""
    main = torch.nn.Parameter(data)
    for attr in _PARALLEL_ATTRS:
        if hasattr(param, attr):
            setattr(main, attr, getattr(param, attr))
    return main

def fp32_main_param_groups(param_groups: List[Dict]):
    """Param groups whose bf16/fp16 params are replaced by fp32 copies (the main params), and
    the map from each main param to its model param."""
    model_of, main_groups = {}, []
    for group in param_groups:
        mains = []
        for param in group["params"]:
            main = param if param.dtype == torch.float32 else \
                main_param_like(param.detach().float(), param)
            model_of[main] = param
            mains.append(main)
        main_groups.append({**group, "params": mains})
    return main_groups, model_of


def copy_main_to_model(pairs: List[Tuple[torch.Tensor, torch.Tensor]],
                       non_blocking: bool = False) -> None:
    """Each main param (fp32) into its model param, in one foreach copy: one launch on CUDA
    instead of one per tensor; the same rounding as ``copy_``, so bitwise the loop's."""
    if pairs:
        torch._foreach_copy_([model.data for _, model in pairs],
                             [main.data for main, _ in pairs], non_blocking=non_blocking)


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """Model params in bf16/fp16; the torch optimizer updates fp32 copies of them (the main
    params), which are copied back to the model after each step."""

    def __init__(self, optimizer: torch.optim.Optimizer, config, grad_scaler,
                 model_param_of: Dict[torch.nn.Parameter, torch.nn.Parameter]):
        super().__init__(optimizer, config, grad_scaler)
        self._model_of = model_param_of

    def _model_param(self, main_param):
        return self._model_of[main_param]

    def _copy_model_grads_to_main_grads(self) -> None:
        for main, model in self._model_of.items():
            grad = _model_grad(model)
            if grad is None:
                main.grad = None
            elif main is model:
                model.grad = grad
            else:
                # fp32 grads for the fp32 update (the DDP buffer itself when it is fp32 already:
                # unscaling and clipping then work in place, as in Megatron)
                main.grad = grad.float()

    def _copy_main_params_to_model_params(self) -> None:
        copy_main_to_model([(main, model) for main, model in self._model_of.items()
                            if main is not model])

    def zero_grad(self) -> None:
        super().zero_grad()
        for model in self._model_of.values():
            model.grad = None
