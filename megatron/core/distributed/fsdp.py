"""ZeRO-2/3 through torch's FSDP2 (``fully_shard``) over the data-parallel group.

    model = TorchFSDP2(config, TorchFSDP2Config(reshard_after_forward=True), model_chunk)

Each transformer layer, then the whole chunk (embedding, final norm, output layer), is a
``fully_shard`` unit over a 1-D mesh of this rank's DP group (routed experts: expert-DP).
Under tensor parallelism the tensor FSDP shards is this TP rank's local weight, so TP's
collectives are untouched. After
sharding every parameter is a DTensor split on dim 0 over DP, and backward leaves each rank the
DP-averaged gradient of its own shard in ``.grad`` (a DTensor): there is no ``main_grad``, so
gradient-accumulation fusion falls back to ordinary autograd by itself.

``TorchFSDP2`` offers the loop what ``DistributedDataParallel`` does (``no_sync``,
``zero_grad_buffer``, ``finish_grad_sync``); ``FSDP2Optimizer`` is the fp32 optimizer over the
sharded parameters, with the gradient norm summed over shards (DP) and TP/PP as today.

Mixed precision: the sharded parameters are fp32 (they are the main params); bf16 (fp16)
copies are all-gathered for compute and gradients are reduced in fp32 unless
``grad_reduce_in_fp32`` is off (--grad-reduce-in-bf16). fp16 scales the loss as Megatron does:
the optimizer unscales the fp32 gradient shards, and an inf or NaN on any rank skips the step
on every rank (the check is summed over the world).

HSDP (``num_distributed_optimizer_instances`` N > 1, optimizer_instances.py): the mesh is
2-D, (N instances, DP x CP / N ranks of one): each unit is sharded within an instance and
replicated across them, so its all-gather and reduce-scatter stay inside an instance (a node)
and only the reduced shard is all-reduced across instances. Instance 0 alone counts the shards
in the gradient norm and writes them to checkpoints.

CPU offload (``cpu_offload``, --optimizer-cpu-offload): torch's CPUOffloadPolicy keeps the fp32
shards, their gradients and so the optimizer state and step on the host; each unit's shards
are copied to the device for its all-gather and its reduced gradients copied back (pinned on
CUDA). The device then holds only what is gathered for compute (FSDP2HostOptimizer).

Checkpoints: the sharded format only (fsdp_checkpoint.py): each rank writes its own rows of
every weight and optimizer state, readable by any layout (DDP, the distributed optimizer, FSDP2
at any DP), and reads its own rows of any layout's checkpoint.

Pipeline parallelism (1F1B, interleaved, zero-bubble): each model chunk of this rank is its own
``TorchFSDP2`` (its own FSDP root) over this stage's DP (x CP) group; nothing is sharded across
stages. Across microbatches the policy is the flag's: ZeRO-3 (default) gathers each layer for
its forward and again for its backward, every microbatch (two all-gathers per layer per
microbatch; held: a layer or two at a time); ``--no-reshard-after-forward`` (torchtitan's
choice under PP) keeps a layer gathered from a forward until a backward frees it, one
all-gather per layer per microbatch, and under 1F1B, with up to PP microbatches in flight, that
is most of the stage's layers gathered through the step (up to the stage's unsharded weights in
the compute dtype). The gradients are reduce-scattered every microbatch, as without PP (see
``no_sync``). The tied embedding's copies (first and last stage) have the same shape and are
sharded alike over DP groups of one size, so their local rows are summed over the embedding
group (tied_embeddings.py); the norm sums over every rank (FSDP2Optimizer).

The zero-bubble schedules (ZB-H1, ZB-V) split each backward into B (input gradients) and a
deferred W (weight gradients, weight_grad_store.py). FSDP2 would reduce-scatter a layer when
its B is done, before its W exists, so under them every reduction is held: each backward
leaves the units' gradients unsharded (accumulated over the microbatches, in the reduce
dtype), and ``finish_grad_sync``, after the last W, reduce-scatters each unit once, as torch's
own pipelining does. The price is DDP's: the stage's unsharded gradients live from the first
backward to the end of the iteration (the memory estimate counts them); the gathers are as
above.

Mixture of experts: each MoE layer's routed-expert module is sharded first, over a mesh of
the expert-DP group (the ranks holding the same experts), so the layer's unit leaves it out;
its reduce-scatter divides by DP x CP (DDP's factor: the all-to-all's backward already summed
the EP ranks' tokens), not by the expert-DP size. Stacked [E/EP, ...] weights are cut on dim 0;
with fewer local experts than expert-DP ranks the last ranks hold none.

Not composed (refused by the flags): the distributed optimizer (FSDP2 is the sharded
optimizer), Muon (it orthogonalizes whole matrices; FSDP2 holds row shards of them) and the
torch checkpoint format (there is no whole state dict to gather).
"""
import contextlib
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.distributed as dist

from megatron.core import device, expert_parallel_state, optimizer_instances, parallel_state
from megatron.core.distributed.distributed_data_parallel import check_instances
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.distributed.fsdp_checkpoint import is_sharded, local_rows
from megatron.core.optimizer.cpu_offload import HostStep
from megatron.core.optimizer.named_state import (
    check_covers,
    check_numel,
    load_scaler_and_counters,
    load_torch_state,
    saved_range,
    state_keys,
    wrap_state,
)
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.pipeline_parallel.schedule_order import ZERO_BUBBLE
from megatron.core.transformer.transformer_layer import TransformerLayer

_SHARDED_ONLY = ("--use-torch-fsdp2 saves and loads the sharded checkpoint format only "
                 "(--ckpt-format torch_dist): there is no whole state dict to gather.")


@dataclass
class TorchFSDP2Config(DistributedDataParallelConfig):
    """--use-torch-fsdp2. ``reshard_after_forward``: free each layer's gathered parameters after
    its forward and gather them again for backward (ZeRO-3); False keeps them until backward
    (ZeRO-2: sharded gradients and optimizer state, more memory, one all-gather less)."""
    use_torch_fsdp2: bool = True
    reshard_after_forward: bool = True
    # --optimizer-cpu-offload: torch's CPUOffloadPolicy (the fp32 shards, their gradients and
    # so the optimizer state and step on the host; each unit's shards copied to the device
    # for its all-gather, its reduced gradients back).
    cpu_offload: bool = False
    # Reduce-scatter each unit once per iteration, after the last backward, instead of once
    # per microbatch: the units' unsharded gradients are held (accumulated) in between. The
    # zero-bubble schedules need it (module docstring); elsewhere it trades that memory for
    # (microbatches - 1) fewer reduce-scatters (BENCHMARKS.md measures both).
    reduce_gradients_once: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.use_distributed_optimizer or self.overlap_grad_reduce or \
                self.overlap_param_gather or self.bucket_size is not None:
            raise ValueError("--use-torch-fsdp2 shards the optimizer and overlaps its own "
                             "collectives: drop --use-distributed-optimizer, "
                             "--overlap-grad-reduce, --overlap-param-gather, --ddp-bucket-size.")


def is_fsdp2(model_chunks: List[torch.nn.Module]) -> bool:
    return any(isinstance(chunk, TorchFSDP2) for chunk in model_chunks)


def _parallel_attrs(module: torch.nn.Module) -> dict:
    """Our attributes on each parameter (tensor_model_parallel, sequence_parallel, ...):
    ``fully_shard`` replaces the parameters and drops them."""
    return {name: dict(vars(p)) for name, p in module.named_parameters()}


def _restore_parallel_attrs(module: torch.nn.Module, attrs: dict) -> None:
    for name, param in module.named_parameters():
        for key, value in attrs[name].items():
            if not hasattr(param, key):
                setattr(param, key, value)


def _routed_experts(layer: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of ``layer`` whose own parameters are routed experts' weights."""
    return [m for m in layer.modules()
            if any(True for _ in m.parameters(recurse=False))
            and all(getattr(p, "expert_parallel", False) for p in m.parameters(recurse=False))]


def _mesh(device_mesh_class, expert: bool):
    """The mesh a unit is sharded over: 1-D over the DP x CP group (experts: expert-DP), or
    under HSDP 2-D, (instances, ranks of an instance): fully_shard then reduce-scatters and
    all-gathers within an instance and all-reduces the shards across instances. Named after
    the shard group: meshes over the same ranks compare equal otherwise, and DTensor's caches
    would hand back one holding a destroyed group (parallel_state initialised again in the
    same process)."""
    shard = optimizer_instances.shard_group(expert)
    name = f"{'edp' if expert else 'dp'}_{shard.group_name}"
    replica = optimizer_instances.replica_group(expert)
    if replica is None:
        return device_mesh_class.from_group(shard, device.device_type(),
                                            mesh_dim_names=(name,))
    # Instance i is ranks [i x size, (i + 1) x size) of the data group (optimizer_instances).
    whole = (expert_parallel_state.get_expert_data_parallel_ranks() if expert
             else parallel_state.get_data_parallel_ranks(with_context_parallel=True))
    layout = torch.tensor(whole).view(optimizer_instances.num_instances(), -1)
    return device_mesh_class.from_group([replica, shard], device.device_type(), mesh=layout,
                                        mesh_dim_names=(f"{name}_replica", name))


class TorchFSDP2(torch.nn.Module):
    def __init__(self, config, fsdp_config: TorchFSDP2Config, module: torch.nn.Module):
        # Imported here: torch's FSDP and DTensor cost about 1 s of every process start.
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        super().__init__()
        self.config = config
        self.ddp_config = fsdp_config
        check_instances(fsdp_config)
        self._broadcast_params(module,
                               parallel_state.get_data_parallel_group(with_context_parallel=True))
        mesh = _mesh(DeviceMesh, expert=False)
        expert_mesh = (_mesh(DeviceMesh, expert=True)
                       if expert_parallel_state.expert_parallel_is_initialized() else None)
        compute_dtype = config.params_dtype  # fp16: the optimizer's loss scale (below)
        # fp32 shards are the main params (as Float16Optimizer's fp32 copies of bf16 weights).
        attrs = _parallel_attrs(module)
        module.float()
        reduce_dtype = torch.float32 if fsdp_config.grad_reduce_in_fp32 else compute_dtype
        # Inputs as the unsharded model gets them (rotary cos/sin stay fp32, as under DDP).
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                                      cast_forward_inputs=False)
        # Pinned host memory only where there is a device to copy to asynchronously.
        offload = (CPUOffloadPolicy(pin_memory=device.device_type() == "cuda")
                   if fsdp_config.cpu_offload else OffloadPolicy())
        dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        for layer in module.modules():
            if isinstance(layer, TransformerLayer):
                # Routed experts first, over the ranks holding the same experts (expert-DP),
                # so the layer's unit leaves them out. Their gradients are divided by DP x CP
                # as DDP's: the all-to-all's backward already summed the EP ranks' tokens.
                for experts in _routed_experts(layer):
                    fully_shard(experts, mesh=expert_mesh, mp_policy=policy,
                                reshard_after_forward=fsdp_config.reshard_after_forward,
                                offload_policy=offload)
                    experts.set_gradient_divide_factor(float(dp_size))
                    # Sum, then divide: the fused pre-multiplied sum (NCCL) is not in gloo.
                    # Not where the shard dimension has one rank: torch then divides the copied
                    # gradient by the factor itself, and a forced sum would divide it again.
                    if expert_mesh.size(expert_mesh.ndim - 1) > 1:
                        experts.set_force_sum_reduction_for_comms(True)
                fully_shard(layer, mesh=mesh, mp_policy=policy,
                            reshard_after_forward=fsdp_config.reshard_after_forward,
                            offload_policy=offload)
        # The root unit (embedding, final norm, output layer) stays gathered after forward:
        # backward starts with the output layer, so resharding would gather it again at
        # once. torch does this itself only when reshard_after_forward is left to None.
        # Under PP every chunk is such a root (a middle stage's holds no parameters); its
        # backward reshards it, so with microbatches in flight it is gathered again at the
        # next forward, as the layers are.
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False,
                    offload_policy=offload)
        _restore_parallel_attrs(module, attrs)
        self.module = module
        # Zero-bubble schedules: a layer's deferred weight gradients (W) arrive after its
        # input gradient (B), where FSDP2 would reduce-scatter the layer. Every backward then
        # accumulates unsharded gradients and the reduction waits for finish_grad_sync,
        # after the last W (torch's own pipelining does the same).
        self.reduce_at_end = fsdp_config.reduce_gradients_once or \
            getattr(config, "pipeline_schedule", None) in ZERO_BUBBLE
        self._hold_reductions(self.reduce_at_end)

    def _hold_reductions(self, hold: bool) -> None:
        self.module.set_requires_gradient_sync(not hold)
        self.module.set_is_last_backward(not hold)

    @staticmethod
    def _broadcast_params(module: torch.nn.Module, group) -> None:
        """Every DP replica shards DP rank 0's weights (as DDP starts from them); routed
        experts come from expert-DP rank 0 (the DP group's EP ranks hold other experts)."""
        src = parallel_state.get_data_parallel_ranks(with_context_parallel=True)[0]
        with torch.no_grad():
            for param in module.parameters():
                if getattr(param, "expert_parallel", False):
                    dist.broadcast(param.data,
                                   src=expert_parallel_state.get_expert_data_parallel_ranks()[0],
                                   group=expert_parallel_state.get_expert_data_parallel_group())
                else:
                    dist.broadcast(param.data, src=src, group=group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Nothing held back by default: every microbatch's gradients are reduce-scattered
        and summed into the sharded ``.grad`` (as torchtitan does). Holding the reduction to
        the last microbatch (``reduce_gradients_once``, --fsdp2-reduce-gradients-once) keeps
        every unit's unsharded gradient alive across the microbatches (4 bytes per parameter
        in fp32, the stage's under PP), ZeRO's gradient saving lost, for one reduce-scatter
        per unit per step instead of per microbatch. Measured on CPU (gloo, DP 2,
        bench/memory_modes.py, BENCHMARKS.md): holding is 12% faster at 2 microbatches and
        15% at 8, its peak 7% higher; there the reduce-scatters hide behind nothing, while on
        CUDA a layer's reduce-scatter overlaps the backward of the layer below. The default
        stays per microbatch (memory is why one picks FSDP2); the flag is for runs with
        memory to spare. The zero-bubble schedules hold every reduction regardless (module
        docstring)."""
        yield

    def zero_grad_buffer(self) -> None:
        for param in self.module.parameters():
            param.grad = None

    def finish_grad_sync(self) -> None:
        """Nothing to wait for: FSDP's end-of-backward callback has waited for the last
        reduce-scatter before backward returned. Under a zero-bubble schedule (every W done
        now) each unit's accumulated unsharded gradients are reduce-scattered here, once."""
        if not self.reduce_at_end:
            return
        self._hold_reductions(False)
        root, groups = self._param_groups()
        for group in groups:
            group.post_backward()
        root._root_post_backward_final_callback()  # waits for the reductions, resets state
        self._hold_reductions(True)

    def _param_groups(self):
        """(the root's FSDP state, every unit's parameter group in backward's order within
        each state): torch's private state, reached as torch's own pipelining reaches it."""
        from torch.distributed.fsdp import fully_shard

        root = fully_shard.state(self.module)
        return root, [group for state in root._state_ctx.all_states
                      for group in reversed(state._fsdp_param_groups)]

    def held_gradients(self) -> List[torch.Tensor]:
        """The unsharded gradients FSDP2 holds now (between backwards: only while reductions
        wait, ``reduce_at_end``): each parameter's accumulated one (in the reduce dtype) or
        its unsharded ``.grad``."""
        held = []
        for group in self._param_groups()[1]:
            for param in group.fsdp_params:
                grad = param.unsharded_accumulated_grad
                if grad is None and hasattr(param, "_unsharded_param"):
                    grad = param.unsharded_param.grad
                if grad is not None:
                    held.append(grad)
        return held

    def finish_param_sync(self) -> None:
        """Before a save: every parameter back to its shard (a forward without backward, as
        in evaluation, leaves ZeRO-2's layers gathered), so the state dict holds DTensors."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def state_dict(self, *args, **kwargs):
        raise NotImplementedError(_SHARDED_ONLY)

    def load_state_dict(self, state_dict, strict: bool = True):
        raise NotImplementedError(_SHARDED_ONLY)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_sharded(tensor) else tensor


class FSDP2Optimizer(FP32Optimizer):
    """The torch optimizer steps the fp32 DTensor shards with their DTensor gradients. Norms,
    clipping and the inf check work on the local shards; their sums are added over every rank
    (DP shards x the model-parallel ranks, duplicates excluded as today)."""

    def _main_params_and_grads(self) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(p, _local(p.grad)) for group in self.optimizer.param_groups
                for p in group["params"] if p.grad is not None]

    def _reduction_group(self):
        return dist.group.WORLD

    def _local_value(self, main: torch.nn.Parameter) -> torch.Tensor:
        return _local(main.detach())

    def _main_ranges(self):
        # This rank's rows of each parameter (QK-clip scales them; the next forward's
        # all-gather spreads them).
        ranges = []
        for main in self._main_params():
            begin, local = local_rows(main)
            ranges.append((local.view(-1), main, begin, begin + local.numel()))
        return ranges

    def state_dict(self):
        raise NotImplementedError(_SHARDED_ONLY)

    # --- the sharded checkpoint format (named_state.py's names, this rank's rows) ------------
    def _saves_main_copy(self) -> bool:
        """Under bf16 the fp32 shards are also saved as the fp32 main params ("param"), so a
        mixed-precision DDP run resumes from them and not from rounded weights."""
        return bool(self.config.bf16 or self.config.fp16)

    def sharded_state(self):
        """([(name, begin, end, {key: 1-D local tensor})], the rest of the state): this rank's
        rows of every parameter's state, nothing gathered (as the distributed optimizer's)."""
        keys = state_keys(self.optimizer, lambda p, v: v.shape == p.shape)
        parts, step = [], None
        for main in self._main_params():
            begin, local = local_rows(main)
            state = self.optimizer.state.get(main, {})
            if "step" in state:  # every rank steps every parameter: the same value everywhere
                step = float(state["step"])
            if optimizer_instances.instance_rank() > 0:
                continue  # HSDP: instance 0's ranks write the rows every instance holds
            values = {"param": local.detach().reshape(-1)} if self._saves_main_copy() else {}
            values.update({k: _local(state[k]).detach().reshape(-1) for k in keys if k in state})
            parts.append((self._names[main], begin, begin + local.numel(), values))
        return parts, wrap_state(self.optimizer, {}, step, keys, self.num_skipped_steps,
                                 self.grad_scaler)

    def load_state_dict(self, state):
        """Named state of any optimizer at any layout (tensors or SavedTensors): this rank
        reads only its rows. The model's weights are loaded first (they are the main params
        where the checkpoint holds no separate fp32 copy)."""
        mains = self._main_params()
        check_covers(state, [self._names[m] for m in mains])
        per_param = {}
        with torch.no_grad():
            for main in mains:
                name, (begin, local) = self._names[main], local_rows(main)
                saved = state["params"][name]

                def rows(value, local=local, begin=begin):
                    return saved_range(value, begin, begin + local.numel()).view_as(local)

                if "param" in saved:
                    check_numel(name, saved["param"], main)
                    local.copy_(rows(saved["param"]))
                if state["step"] is not None:
                    per_param[main] = {"step": torch.tensor(state["step"])}
                    for key in state["state_keys"]:
                        if key in saved:
                            check_numel(name, saved[key], main)
                            value = torch.zeros_like(main)  # a DTensor sharded as the param
                            _local(value).copy_(rows(saved[key]))
                            per_param[main][key] = value
        load_torch_state(self.optimizer, per_param, state["param_groups"])
        load_scaler_and_counters(self, state)


class FSDP2HostOptimizer(HostStep, FSDP2Optimizer):
    """FSDP2 with its shards offloaded (``TorchFSDP2Config.cpu_offload``): the same step on the
    host tensors FSDP2 leaves there, with the inf check on the host (HostStep)."""
