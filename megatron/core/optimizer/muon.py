"""Muon: momentum orthogonalized by Newton-Schulz for the transformer layers' matrices, AdamW
for the rest (embeddings, output layer, norms, biases, routers).

Per matrix W with gradient G (torch.optim.Muon's arithmetic, op for op):

    B <- lerp(B, G, 1 - momentum)                  (momentum buffer, "momentum_buffer")
    U <- lerp(G, B, momentum) if nesterov else B
    O <- NS(U)                                      (5 quintic Newton-Schulz steps)
    W <- W * (1 - lr * weight_decay)                (decoupled, as AdamW)
    W <- W - lr * extra_scale_factor * scale(shape) * O

The orthogonalization is of the WHOLE matrix: a tensor-parallel shard's update is all-gathered
over its TP group (``--muon-tp-mode duplicated``, Megatron's name), every TP rank runs Newton-Schulz on the full
matrix and keeps its own rows / columns. Every TP rank rather than one per matrix: the gather
is needed either way, repeating the iteration saves a scatter back, and every TP rank's update
is bitwise the same. (Over DP, under the distributed optimizer, each matrix has one owner
rank: ShardedMatrices.) Experts' stacked [E, out, in] weights are E matrices (gathered over
the expert-TP group).

The momentum lives in the torch optimizer's state as ``momentum_buffer`` with the parameter's
shape, so the named-state checkpoints (named_state.py) hold it by parameter name like Adam's.
"""
import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.model_chunks import unwrap_model

# Keller Jordan's quintic coefficients and torch.optim.Muon's eps (the same numbers).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")


def newton_schulz(matrix: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32,
                  coefficients: Tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalized ``matrix`` (~ U V^T of its SVD), computed in ``dtype``; with bf16,
    bitwise torch.optim.Muon's ``_zeropower_via_newtonschulz``."""
    a, b, c = coefficients
    x = matrix.to(dtype, copy=True)  # divided in place below: never the momentum itself
    tall = matrix.size(0) > matrix.size(1)
    if tall:  # X X^T is the smaller Gram matrix
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def scale_factor(mode: str, rows: int, cols: int) -> float:
    """The update's scale for a [rows (out), cols (in)] matrix. shape_scaling is
    torch.optim.Muon's "original"; spectral with --muon-extra-scale-factor 0.2 is its
    "match_rms_adamw" (Moonlight's AdamW-matched RMS)."""
    if mode == "shape_scaling":
        return math.sqrt(max(1, rows / cols))
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(f"--muon-scale-mode {mode!r}: use one of {', '.join(SCALE_MODES)}.")


@dataclass(frozen=True)
class MatrixLayout:
    """Where a parameter's whole matrices are. ``group``: the TP group its shards are spread
    over (None: whole here), cut along ``dim`` into ``stride`` x TP blocks, rank r holding
    blocks r, r + TP, ... (as tensor_parallel.initialize_affine_weight cuts). ``batched``:
    the leading dim stacks matrices (experts). ``qkv``: (query groups, rows of Q per group,
    rows of K (= of V) per group) to orthogonalize Q, K and V apart (--muon-split-qkv)."""
    group: Optional[dist.ProcessGroup] = None
    dim: int = 0
    stride: int = 1
    batched: bool = False
    qkv: Optional[Tuple[int, int, int]] = None


def gather_full(shard: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """The whole tensor from every TP rank's shard (collective over ``layout.group``)."""
    if layout.group is None or dist.get_world_size(layout.group) == 1:
        return shard
    size = dist.get_world_size(layout.group)
    parts = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(parts, shard.contiguous(), group=layout.group)
    blocks = [part.chunk(layout.stride, dim=layout.dim) for part in parts]
    # block b of the whole is rank b % TP's block b // TP
    return torch.cat([blocks[b % size][b // size] for b in range(layout.stride * size)],
                     dim=layout.dim)


def local_shard(full: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """This rank's shard of ``full`` (the inverse of gather_full)."""
    if layout.group is None or dist.get_world_size(layout.group) == 1:
        return full
    size, rank = dist.get_world_size(layout.group), dist.get_rank(layout.group)
    blocks = full.chunk(layout.stride * size, dim=layout.dim)
    return torch.cat(blocks[rank::size], dim=layout.dim)


class MuonWithAdamW(torch.optim.Optimizer):
    """One torch optimizer over both kinds of groups (``group["use_muon"]``), so the Megatron
    wrappers, the LR scheduler and the named-state checkpoints see one set of param groups
    and one ``state``. The AdamW groups are stepped by a torch AdamW sharing those group
    dicts and that state: bitwise torch's AdamW."""

    def __init__(self, param_groups: List[Dict], layouts: Dict[torch.Tensor, MatrixLayout],
                 lr: float, weight_decay: float, momentum: float = 0.95,
                 nesterov: bool = False, ns_steps: int = 5, scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, ns_dtype: torch.dtype = torch.float32,
                 adamw_kwargs: Optional[Dict] = None):
        scale_factor(scale_mode, 1, 1)  # refuses an unknown mode here, not at the first step
        adam_groups = [g for g in param_groups if not g["use_muon"]]
        self._adam = torch.optim.AdamW(adam_groups, lr=lr, weight_decay=weight_decay,
                                       **(adamw_kwargs or {})) if adam_groups else None
        super().__init__(param_groups, dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, scale_mode=scale_mode, extra_scale_factor=extra_scale_factor))
        self.layouts = layouts
        self.ns_dtype = ns_dtype
        self.sharded = None
        for group in self.param_groups:
            for param in group["params"] if group["use_muon"] else []:
                if param not in layouts:
                    continue  # a flat piece (the distributed optimizer): shard_matrices
                batched = layouts[param].batched
                if param.dim() != (3 if batched else 2):
                    raise ValueError(f"Muon updates matrices; got a parameter of shape "
                                     f"{tuple(param.shape)}: give it to the AdamW groups.")
        self._link_adam()

    def _link_adam(self) -> None:
        if self._adam is not None:  # the same dicts (the scheduler's lr) and the same state
            self._adam.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adam.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # replaces self.state and the group dicts
        self._link_adam()
        for group in self.param_groups:  # the named state gives every param Adam's step:
            for param in group["params"] if group["use_muon"] else []:  # Muon keeps none
                self.state.get(param, {}).pop("step", None)

    def shard_matrices(self, shards, muon_params) -> None:
        """Under the distributed optimizer: this optimizer's Muon params are pieces of the
        flat shards (DistributedOptimizer's ``_Shard``s) of the model params ``muon_params``;
        see ShardedMatrices."""
        self.sharded = ShardedMatrices(shards, muon_params, self.layouts)

    def state_keys_of(self, model_param) -> tuple:
        """Under the distributed optimizer: the state keys of a model param's pieces."""
        if self.sharded is not None and model_param in self.sharded.muon:
            return ("momentum_buffer",)
        return ("exp_avg", "exp_avg_sq")

    @torch.no_grad()
    def step(self, closure=None):
        if self._adam is not None:
            self._adam.step()
        if self.sharded is not None:
            self.sharded.step(self)
            return None
        for group in self.param_groups:
            if group["use_muon"]:
                for param in group["params"]:
                    if param.grad is not None:
                        self._update(param, group)
        return None

    def _momentum(self, param: torch.Tensor, group: Dict) -> torch.Tensor:
        """The momentum step (elementwise: the same on a whole matrix or a flat piece of
        it); returns the matrix to orthogonalize."""
        grad = param.grad
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _update(self, param: torch.Tensor, group: Dict) -> None:
        layout = self.layouts.get(param, MatrixLayout())
        orth = self.orthogonalized(self._momentum(param, group), layout, group)
        apply_update(param, orth, group, self.lr_ratio(param.shape, layout, group))

    def orthogonalized(self, update: torch.Tensor, layout: MatrixLayout,
                       group: Dict) -> torch.Tensor:
        """This rank's shard of NS(the whole matrix of ``update``) (collective over the TP
        group of ``layout``); Q, K and V apart (each scaled) with ``qkv``."""
        full = gather_full(update, layout)
        if layout.batched:
            orth = torch.stack([self._orthogonalize(m, layout, group) for m in full.unbind(0)])
        else:
            orth = self._orthogonalize(full, layout, group)
        return local_shard(orth, layout)

    @staticmethod
    def lr_ratio(shape, layout: MatrixLayout, group: Dict) -> float:
        """The learning rate's factor for a parameter of (local) ``shape``: the scale of its
        whole matrix (1.0 with ``qkv``: folded into each of Q, K, V)."""
        if layout.qkv is not None:
            return 1.0
        rows, cols = shape[-2:]
        if layout.group is not None:
            tp = dist.get_world_size(layout.group)
            dim = layout.dim - (1 if layout.batched else 0)
            rows, cols = (rows * tp, cols) if dim == 0 else (rows, cols * tp)
        return group["extra_scale_factor"] * scale_factor(group["scale_mode"], rows, cols)

    def _orthogonalize(self, matrix: torch.Tensor, layout: MatrixLayout, group: Dict):
        steps, mode, extra = group["ns_steps"], group["scale_mode"], group["extra_scale_factor"]
        if layout.qkv is None:
            return newton_schulz(matrix, steps, self.ns_dtype)
        groups, q_rows, kv_rows = layout.qkv
        per_group = matrix.view(groups, q_rows + 2 * kv_rows, matrix.size(1))
        parts = []
        for piece in per_group.split([q_rows, kv_rows, kv_rows], dim=1):
            whole = piece.reshape(-1, matrix.size(1))  # Q (or K, V) of every group
            ratio = extra * scale_factor(mode, whole.size(0), whole.size(1))
            parts.append((newton_schulz(whole, steps, self.ns_dtype) * ratio)
                         .view(groups, -1, matrix.size(1)))
        return torch.cat(parts, dim=1).view_as(matrix)


class ShardedMatrices:
    """Muon under the distributed optimizer: the momentum is elementwise, so it stays sharded
    as Adam's state (a flat piece per rank, checkpointed by name the same way); only the
    orthogonalization needs whole matrices. Per bucket: each rank's piece of the momentum
    update is all-gathered over the bucket's DP group (expert-DP for experts); each matrix
    has one owner rank (greedy by size, the same on every rank), which alone runs its
    Newton-Schulz (with the TP gather: TP peers own alike); a reduce-scatter of the owners'
    results (zeros elsewhere: the sum is exact) gives every rank its piece of the update."""

    def __init__(self, shards, muon_params, layouts):
        self.muon = set(muon_params)  # a tensor's `in` a list compares values: a set
        self.shards = [s for s in shards if any(p in self.muon for p in s.bucket.param_ranges)]
        self.layouts = layouts
        self.owner = {}
        groups = {}
        for shard in self.shards:
            groups.setdefault(id(shard.bucket.group), []).extend(
                p for p in shard.bucket.param_ranges if p in self.muon)
        for params in groups.values():  # largest first, to the least loaded rank
            group = next(s.bucket.group for s in self.shards
                         if any(p in s.bucket.param_ranges for p in params))
            loads = [0] * dist.get_world_size(group)
            for index in sorted(range(len(params)), key=lambda i: -params[i].numel()):
                rank = loads.index(min(loads))
                self.owner[params[index]] = rank
                loads[rank] += params[index].numel()

    def step(self, optimizer: MuonWithAdamW) -> None:
        from megatron.core.collectives import all_gather_into_tensor, reduce_scatter_tensor
        group_of = {p: g for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
        hyper = next(iter(group_of.values()), optimizer.defaults)  # NS settings: any group's
        for shard in self.shards:
            bucket = shard.bucket
            pieces = [(piece, param, offset) for piece, param, _, _, offset in shard.pieces
                      if param in self.muon]
            # In the NS dtype: NS casts its input to it first, and its output is in it, so a
            # bf16 exchange moves half the bytes for the same bits.
            updates = torch.zeros(bucket.numel, dtype=optimizer.ns_dtype,
                                  device=shard.main.device)
            local = updates[shard.begin:shard.end]
            for piece, _, offset in pieces:
                if piece.grad is not None:
                    local[offset:offset + piece.numel()].copy_(
                        optimizer._momentum(piece, group_of[piece]))
            all_gather_into_tensor(updates, local.clone(), group=bucket.group)
            orth = torch.zeros_like(updates)
            me = dist.get_rank(bucket.group)
            for param, (begin, end) in bucket.param_ranges.items():
                if self.owner.get(param) == me:
                    layout = self.layouts.get(param, MatrixLayout())
                    orth[begin:end].copy_(optimizer.orthogonalized(
                        updates[begin:end].view(param.shape), layout, hyper).reshape(-1))
            mine = torch.empty_like(local)
            reduce_scatter_tensor(mine, orth, group=bucket.group)
            for piece, param, offset in pieces:
                if piece.grad is not None:
                    group = group_of[piece]
                    ratio = optimizer.lr_ratio(param.shape, self.layouts.get(
                        param, MatrixLayout()), group)
                    apply_update(piece, mine[offset:offset + piece.numel()], group, ratio)


def apply_update(param: torch.Tensor, orth: torch.Tensor, group: Dict, ratio: float) -> None:
    """Decoupled weight decay, then the scaled orthogonalized step (torch.optim.Muon's order
    and arithmetic)."""
    lr = group["lr"]
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(orth, alpha=-(lr * ratio))


def is_muon_matrix(name: str, ndim: int) -> bool:
    """The weight matrices (``ndim`` >= 2) of the transformer layers, the MTP depths and the
    experts; not the embeddings, the output layer, norms, biases, routers or the
    shared-expert gate (a vector in effect)."""
    leaf = name.rsplit(".", 1)[-1]
    return (ndim >= 2 and "embedding" not in name and not name.startswith("output_layer")
            and "router" not in name and leaf != "gate_weight"
            and leaf.rstrip("0123456789") != "bias")


def matrix_layouts(model_chunks: List[torch.nn.Module], split_qkv: bool
                   ) -> Dict[torch.nn.Parameter, MatrixLayout]:
    """The MatrixLayout of each Muon parameter of ``model_chunks``, read from the modules:
    TP attributes of the parallel linears, the experts' shard, attention's head layout."""
    layouts = {}
    for chunk in model_chunks:
        for module in unwrap_model(chunk).modules():
            for leaf, param in module.named_parameters(recurse=False):
                layouts[param] = _layout(module, leaf, param)
        for module in unwrap_model(chunk).modules():
            qkv = getattr(module, "linear_qkv", None)
            if split_qkv and qkv is not None and hasattr(module, "heads_per_group"):
                tp = parallel_state.get_tensor_model_parallel_world_size()
                groups = module.local_groups * tp  # the whole matrix's query groups
                layouts[qkv.weight] = replace(
                    layouts[qkv.weight],
                    qkv=(groups, module.heads_per_group * module.head_dim, module.head_dim))
    return layouts


def _layout(module, leaf: str, param) -> MatrixLayout:
    shard = getattr(module, "shard", None)
    if getattr(param, "expert_parallel", False) and param.dim() == 3 and shard is not None:
        # [E, 2f, h] (gate and up cut apart: stride 2) and [E, h, f]
        group = parallel_state.get_expert_tensor_parallel_group() if shard.etp_size > 1 \
            else None
        return MatrixLayout(group, dim=1 if leaf == "weight1" else 2,
                            stride=2 if leaf == "weight1" else 1, batched=True)
    if getattr(param, "tensor_model_parallel", False):
        return MatrixLayout(parallel_state.get_tensor_model_parallel_group(),
                            param.partition_dim, getattr(param, "partition_stride", 1))
    return MatrixLayout()


def muon_param_groups(param_groups: List[Dict], names: Dict[torch.nn.Parameter, str]
                      ) -> List[Dict]:
    """Each group split in two: its Muon matrices (``use_muon``) and the rest (AdamW)."""
    out = []
    for group in param_groups:
        for use_muon in (True, False):
            params = [p for p in group["params"]
                      if is_muon_matrix(names[p], p.dim()) == use_muon]
            if params:
                out.append({**group, "params": params, "use_muon": use_muon})
    return out
