"""The distributed optimizer (ZeRO-1): each data-parallel rank updates only its shard.

DDP (with ``use_distributed_optimizer``) lays parameters and gradients out in flat buckets and
reduce-scatters the gradients, so after the backward pass this rank's shard of every bucket
holds the DP-averaged gradient for a contiguous range that may start or end inside a parameter.
The optimizer's params are the pieces of model parameters inside those ranges: views into an
fp32 shard per bucket (for fp32 models, the parameter buffer's shard itself; for bf16/fp16, an
fp32 copy), so main params and Adam state take ~3 N / DP elements per rank instead of 3 N.
After the step, the shards are all-gathered into every rank's parameters: at once, or
(``overlap_param_gather``) in the background, each module's next forward waiting for its own
bucket.

With ``shard_gradients`` (ZeRO-2) the reduce-scatter writes into a persistent shard buffer per
bucket and the full bucket is freed once reduced (see param_and_grad_buffer): the step reads
the shards, and gradients take N / DP elements per rank from the reduction until the next
iteration's first gradient.

``state_dict()`` is independent of the DP size: it holds, per model parameter, the full fp32
main param and optimizer state, gathered on DP rank 0 (None elsewhere); ``load_state_dict``
takes that dict on every rank and keeps its own slices.
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import device, optimizer_instances, parallel_state
from megatron.core.optimizer.named_state import (
    check_covers,
    check_numel,
    load_scaler_and_counters,
    load_torch_state,
    saved_range,
    state_keys,
    wrap_state,
)
from megatron.core.optimizer.optimizer import (
    MegatronOptimizer,
    copy_main_to_model,
    last_step_tensor,
)


class _Shard:
    """This rank's shard of one bucket: the fp32 main values and the pieces cut from it."""

    def __init__(self, bucket):
        self.bucket = bucket
        self.begin, self.end = bucket.shard_range()
        values = bucket.param_data[self.begin:self.end]
        self.in_place = values.dtype == torch.float32
        self.main = values if self.in_place else values.detach().float()
        # (piece, model param, begin/end within the flattened param, offset in the shard)
        self.pieces = []
        for param, (p_begin, p_end) in bucket.param_ranges.items():
            lo, hi = max(p_begin, self.begin), min(p_end, self.end)
            if lo < hi:
                piece = torch.nn.Parameter(self.main[lo - self.begin:hi - self.begin])
                self.pieces.append((piece, param, lo - p_begin, hi - p_begin, lo - self.begin))

    def main_grads(self) -> torch.Tensor:
        # With sharded gradients (ZeRO-2): the persistent shard buffer, reduced into.
        grads = self.bucket.reduced_grad_shard()
        return grads if grads.dtype == torch.float32 else grads.float()


class DistributedOptimizer(MegatronOptimizer):
    def __init__(self, optimizer_factory, param_groups: List[Dict], config, grad_scaler,
                 model_chunks: List[torch.nn.Module]):
        for chunk in model_chunks:
            if not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer",
                           False):
                raise ValueError("the distributed optimizer needs each model chunk wrapped in "
                                 "DistributedDataParallel with use_distributed_optimizer=True "
                                 "(see ddp_config_for_optimizer).")
        self.model_chunks = model_chunks
        self.shards = [_Shard(bucket) for chunk in model_chunks for bucket in chunk._buckets()]
        # Made once: a save allocates nothing to agree on the step (see _agreed_step).
        self._step_slot = device.zeros(1, dtype=torch.float64)
        group_index = {p: i for i, g in enumerate(param_groups) for p in g["params"]}
        piece_groups = [[] for _ in param_groups]
        self._model_of = {}
        for shard in self.shards:
            for piece, param, *_ in shard.pieces:
                piece_groups[group_index[param]].append(piece)
                self._model_of[piece] = param
        groups = [{**g, "params": pieces} for g, pieces in zip(param_groups, piece_groups)]
        super().__init__(optimizer_factory(groups), config, grad_scaler)
        self.set_param_names(model_chunks)

    # --- the step ------------------------------------------------------------------------------
    def _reduction_group(self):
        return None  # shards differ over DP too: reduce over every rank

    def _replica_ranks(self):
        return None  # ... and no shard is held twice (HSDP's instances: _grads_for_norm)

    def _model_param(self, main_param):
        return self._model_of[main_param]

    def _main_ranges(self):
        # This rank's pieces: QK-clip scales its owned rows here, the all-gather spreads them.
        return [(piece.data, param, begin, end) for shard in self.shards
                for piece, param, begin, end, _ in shard.pieces]

    def _copy_model_grads_to_main_grads(self) -> None:
        self._finish_param_gather()  # the step writes the shards an all-gather may still read
        for shard in self.shards:
            grads = shard.main_grads()
            for piece, _, _, _, offset in shard.pieces:
                piece.grad = grads[offset:offset + piece.numel()]

    def _copy_main_params_to_model_params(self) -> None:
        copy_main_to_model([(shard.main, shard.bucket.param_data[shard.begin:shard.end])
                            for shard in self.shards if not shard.in_place])
        overlap = any(chunk.ddp_config.overlap_param_gather for chunk in self.model_chunks)
        for chunk in self.model_chunks:
            chunk.start_param_sync(async_op=overlap)

    def _finish_param_gather(self) -> None:
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    # --- checkpoints, independent of the DP size (format: named_state.py) --------------------
    def reload_model_params(self) -> None:
        for shard in self.shards:
            if not shard.in_place:
                shard.main.copy_(shard.bucket.param_data[shard.begin:shard.end])

    def state_dict(self, host_tensor=None) -> Optional[Dict]:
        """Full per-parameter optimizer state (and fp32 main params where they are copies):
        dense parameters' on DP rank 0, routed experts' on expert-DP rank 0 (None on ranks
        that are neither). Every rank must call it (it gathers).

        ``host_tensor(name, key, shape)`` gives the fp32 host tensor to fill (e.g. a reused
        pinned buffer for an async save: pinned ones are filled without blocking, so record
        an event before reading them); by default a new one."""
        self._finish_param_gather()
        keys = state_keys(self.optimizer, lambda p, v: v.dim() == 1)
        # The step is agreed before the gather buffer exists, so its small tensors never add
        # to the gather's peak (a backend may free that buffer late, off this thread).
        step = self._agreed_step()
        params = self._gather_state(keys, host_tensor or (
            lambda name, key, shape: torch.empty(shape, dtype=torch.float32)))
        if params is None:
            return None
        return wrap_state(self.optimizer, params, step if step >= 0 else None, keys,
                          self.num_skipped_steps, self.grad_scaler)

    def _agreed_step(self) -> float:
        """The largest Adam step over the DP group, or -1.0 where no rank has stepped (a rank
        whose shard holds no stepped parameter has none of its own). Reduced in a slot made
        once: a collective's own tensors may be released late by the backend's thread, and
        would then count against the gather that follows."""
        step = last_step_tensor(self.optimizer, [piece for shard in self.shards
                                                 for piece, *_ in shard.pieces])
        if not torch.is_tensor(step):
            self._step_slot.fill_(-1.0 if step is None else step)
        else:  # a copy, not a float(): no host read per piece (one sync each on CUDA)
            self._step_slot.copy_(step.reshape(1))
        dist.all_reduce(self._step_slot, op=dist.ReduceOp.MAX,
                        group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        return float(self._step_slot.item())

    def _gather_state(self, keys, host_tensor):
        """{name: {key: host tensor}} on the ranks where some bucket's group has rank 0 (DP
        rank 0 for dense buckets, expert-DP rank 0 for expert buckets), else None.

        One state key of one bucket at a time is gathered to its group's rank 0 and copied
        to host before the next, into one device buffer: the whole bucket on that rank, one
        shard elsewhere. That is the extra device memory of a save (every key of the whole
        model at once would not fit next to it)."""
        if optimizer_instances.instance_rank() > 0:
            return None  # HSDP: instance 0 holds the same state (each gather is per instance)
        roots = [dist.get_rank(s.bucket.group) == 0 for s in self.shards]
        dp_root = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        params: Optional[Dict[str, Dict[str, torch.Tensor]]] = \
            {} if dp_root or any(roots) else None
        buffer = None
        if self.shards and (keys or not all(s.in_place for s in self.shards)):
            buffer = device.empty(max(s.bucket.numel if root else s.end - s.begin
                                      for s, root in zip(self.shards, roots)),
                                  dtype=torch.float32)
        for shard, root in zip(self.shards, roots):
            group = shard.bucket.group
            size = shard.end - shard.begin
            if root:  # entries in the file's order: per parameter, "param" first
                for param in shard.bucket.param_ranges:
                    params[self._names[param]] = {}
            for key in ([] if shard.in_place else ["param"]) + keys:
                local = buffer[:size]  # on the root also its slot of the gathered bucket
                if key == "param":
                    local.copy_(shard.main)
                else:
                    for piece, _, _, _, offset in shard.pieces:
                        value = self.optimizer.state.get(piece, {}).get(key)
                        target = local[offset:offset + piece.numel()]
                        if value is None:
                            target.zero_()
                        else:
                            target.copy_(value)
                gather_list = None
                if root:
                    gather_list = [local] + [buffer[r * size:(r + 1) * size]
                                             for r in range(1, dist.get_world_size(group))]
                dist.gather(local, gather_list, dst=dist.get_global_rank(group, 0),
                            group=group)
                if root:
                    for param, (p_begin, p_end) in shard.bucket.param_ranges.items():
                        if not self._has_state(param, key):
                            continue  # Muon's matrices have no Adam moments, nor the reverse
                        name = self._names[param]
                        host = host_tensor(name, key, param.shape)
                        host.copy_(buffer[p_begin:p_end].view(param.shape),
                                   non_blocking=host.is_pinned())
                        params[name][key] = host
        return params

    def _has_state(self, param, key: str) -> bool:
        """Whether ``param`` has state ``key`` (every key unless the torch optimizer says
        which: Muon's matrices and its AdamW parameters differ)."""
        keys_of = getattr(self.optimizer, "state_keys_of", None)
        return key == "param" or keys_of is None or key in keys_of(param)

    def sharded_state(self):
        """This DP rank's own part of the named state, nothing gathered (the sharded
        checkpoint format): ([(name, begin, end, {key: 1-D tensor})], the rest of the state,
        with the step agreed over DP). Collective over the DP group."""
        self._finish_param_gather()
        keys = state_keys(self.optimizer, lambda p, v: v.dim() == 1)
        step = self._agreed_step()
        parts = []
        # HSDP: every instance holds the same rows; instance 0's ranks write them.
        for shard in self.shards if optimizer_instances.instance_rank() == 0 else []:
            for piece, param, begin, end, _ in shard.pieces:
                values = {} if shard.in_place else {"param": piece.detach()}
                state = self.optimizer.state.get(piece, {})
                values.update({k: state[k].detach() for k in keys if k in state})
                parts.append((self._names[param], begin, end, values))
        meta = wrap_state(self.optimizer, {}, step if step >= 0 else None, keys,
                          self.num_skipped_steps, self.grad_scaler)
        return parts, meta

    def load_state_dict(self, state: Dict) -> None:
        """``state`` from any optimizer's ``state_dict()`` at any DP size; the same dict on
        every rank. The model's weights must be loaded first (they are the main params
        wherever the checkpoint holds no separate fp32 copy)."""
        self._finish_param_gather()
        check_covers(state, list(self._names.values()))
        per_piece = {}
        with torch.no_grad():
            for shard in self.shards:
                for piece, param, begin, end, _ in shard.pieces:
                    key = self._names[param]
                    saved = state["params"][key]
                    if "param" in saved:
                        check_numel(key, saved["param"], param)
                        piece.copy_(saved_range(saved["param"], begin, end))
                    else:
                        piece.copy_(param.detach().reshape(-1)[begin:end])
                    if state["step"] is not None:
                        per_piece[piece] = {"step": torch.tensor(state["step"]), **{
                            k: saved_range(saved[k], begin, end).to(piece.device, copy=True)
                            for k in state["state_keys"] if k in saved}}
        load_torch_state(self.optimizer, per_piece, state["param_groups"])
        load_scaler_and_counters(self, state)
        for shard in self.shards:
            if not shard.in_place:
                shard.bucket.param_data[shard.begin:shard.end].copy_(shard.main)
        for chunk in self.model_chunks:
            chunk.start_param_sync(async_op=False)
