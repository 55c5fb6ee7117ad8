"""Split backward for the zero-bubble pipeline schedules: B now, W later.

A zero-bubble schedule splits each backward of a (chunk, microbatch) into B, the input
gradient (on the pipeline's critical path: the previous stage waits for it), and W, the weight
gradient (needed only by the optimizer step, so it can fill the bubbles). While a backward runs
inside ``deferring_weight_grads(store)``, the column- and row-parallel linear layers compute
and communicate their input gradient as usual and push their weight-gradient GEMM into
``store``; ``store.flush()`` is the W step and runs the deferred work in FIFO order.

What splits: every ``ColumnParallelLinear`` / ``RowParallelLinear`` weight (QKV, attention
projection, the MLP's fc1/fc2, the output layer, and a last stage's copy of a tied output
weight): these GEMMs are about a third of a layer's backward FLOPs. What runs whole in B:
  * biases: the gradient is a column sum of the output gradient, tiny next to the GEMMs;
  * norms (RMSNorm/LayerNorm weights): elementwise, a few vectors per layer;
  * the embedding lookup: a scatter-add of the output gradient, no GEMM to save;
  * the attention core, rotary, activations and cross entropy: no weights at all;
  * an output layer given the embedding's own weight (``weight=`` passed in, embedding and
    output in one chunk, i.e. no pipeline): autograd sums the lookup's and the GEMM's
    gradients before accumulating them; deferring one of the two would add them in another
    order (``(G + a) + b`` instead of ``G + (a + b)``), so that GEMM stays in B (bitwise).
Splitting the small ones would lengthen B (more kernels, more records) and save nothing
worth having in W; B must stay short because it is on the critical path.

W is the whole backward's arithmetic (the same function computes both, see
``layers.LinearWithGradAllReduce``), delivered as autograd's accumulation on the leaf would
(``_deliver``: ``.grad`` is set or added to in place, then the post-accumulate-grad hooks,
DDP's ``_grad_ready`` with ZeRO-2's ``ensure_full_grad``, fire once per deferred gradient,
exactly as in a whole backward), called directly: ``torch.autograd.backward(param, grad)``
started autograd's engine once per weight, for one add. Caveat: autograd also visits a
deferred weight's leaf in B, with no gradient, and runs its post-accumulate hooks there with
``.grad`` None; a hook must ignore that visit (DDP's ``_grad_ready`` needs that guard). Under sequence parallelism a
record keeps only this rank's input shard and W all-gathers it over TP synchronously: every TP
rank runs the same W sequence, so the collectives match.

The current store is process-global, not thread-local: on CUDA autograd runs backward
functions on its own device threads, which would not see a thread-local set by the caller.
"""
import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch

_STORES: List[Optional["WeightGradStore"]] = []


@dataclass
class DeferredWeightGrad:
    """One deferred weight gradient: ``compute(*held)`` returns the gradient to deliver to
    ``param`` (the computed one, or a placeholder after accumulating into ``main_grad``)."""
    param: torch.Tensor
    held: Tuple[torch.Tensor, ...]
    compute: Callable[..., torch.Tensor]


class WeightGradStore:
    """Deferred weight-gradient work in FIFO order (one store per W the schedule runs)."""

    def __init__(self):
        self._records: deque = deque()

    def push(self, record: DeferredWeightGrad) -> None:
        self._records.append(record)

    def pending(self) -> int:
        return len(self._records)

    def bytes_held(self) -> int:
        """Bytes of the tensors the pending records keep alive (output gradients and saved
        inputs): what deferring W costs in memory until the flush."""
        return sum(t.nbytes for record in self._records for t in record.held)

    def flush(self) -> None:
        """The W step: compute and deliver every pending weight gradient, oldest first."""
        while self._records:
            record = self._records.popleft()  # dropped even if it raises: no half-run rerun
            with torch.no_grad():
                grad = record.compute(*record.held)
            _deliver(record.param, grad)


def _deliver(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate ``grad`` into ``param`` the way autograd's AccumulateGrad ends a whole
    backward, then run the parameter's post-accumulate-grad hooks (DDP's ``_grad_ready``): the
    same arithmetic and bookkeeping as ``torch.autograd.backward(param, grad)``, without
    starting autograd's engine once per weight."""
    if grad.dtype != param.dtype:  # what autograd's engine does to a node's output
        grad = grad.to(param.dtype)
    if param._backward_hooks:  # tensor hooks rewrite the gradient first: autograd runs them
        torch.autograd.backward(param, grad)
        return
    with torch.no_grad():
        if param.grad is None:
            param.grad = _in_layout_of(param, grad)
        else:
            param.grad += grad  # AccumulateGrad's in-place add (no create_graph here)
    for hook in tuple((param._post_accumulate_grad_hooks or {}).values()):
        hook(param)


def _in_layout_of(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """AccumulateGrad's layout contract: a first ``.grad`` has the parameter's strides."""
    if grad.stride() == param.stride():
        return grad.detach()
    return torch.empty_strided(param.shape, param.stride(), dtype=param.dtype,
                               device=param.device).copy_(grad)


def current_weight_grad_store() -> Optional[WeightGradStore]:
    """The store the linear layers defer into now, or None (a whole backward)."""
    return _STORES[-1] if _STORES else None


@contextlib.contextmanager
def deferring_weight_grads(store: Optional[WeightGradStore]) -> Iterator[None]:
    """Backwards run inside defer their linear weight gradients into ``store`` (None: whole
    backwards). Nests; the previous store is restored on exit, exceptions included."""
    _STORES.append(store)
    try:
        yield
    finally:
        _STORES.pop()


__all__ = ["DeferredWeightGrad", "WeightGradStore", "current_weight_grad_store",
           "deferring_weight_grads"]
