"""A test process group that behaves like nccl where gloo hides bugs.

gloo finishes an asynchronous collective on the host, often before ``wait()`` is even called,
so code that reads a collective's output before waiting for it passes on CPU and races on
nccl (where the output is written later, on another stream). This group wraps gloo and makes
every such read visible:

- an asynchronous collective's outputs hold poison until ``wait()`` returns (NaN for floats,
  the dtype's largest value for integers: FP8 bytes 0xFF are NaN too); what nccl leaves alone
  (an in-place all-gather's own chunk, a broadcast's root) stays as it was;
- an input changed between the call and ``wait()`` is an error (nccl may still be reading it);
- point-to-point messages match by order only, as on nccl, which has no tags.

The collective itself runs on private copies of the inputs, so its result is gloo's exactly.
Used by the rank pool (tests/distributed.py) when ``MEGATRON_TEST_NCCL_FAITHFUL=1``: every
group of the run, made by ``init_process_group`` or ``new_group``, is one of these.
"""
import datetime
from typing import Callable, List, Sequence

import torch
import torch.distributed as dist

BACKEND = "nccl_faithful"
ENV = "MEGATRON_TEST_NCCL_FAITHFUL"


class InputChangedBeforeWait(RuntimeError):
    """An asynchronous collective's input was written before its wait(): a race on nccl."""


def poison(tensor: torch.Tensor) -> None:
    """Fill with a value no correct computation produces from real data."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).max)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).clone()


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _private(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]


class _Pending(dist.Work):
    """The caller's handle: wait() finishes gloo's work, checks the inputs were left alone,
    then writes the results into the caller's outputs."""

    def __init__(self, name: str, inner: Sequence, deliver: Callable[[], None],
                 watched: Sequence[torch.Tensor]):
        super().__init__()
        self.name, self.inner, self.deliver = name, list(inner), deliver
        self.watched = [(t, _bytes(t)) for t in watched]
        self.done = False

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - gloo's own timeout applies
        if self.done:
            return True
        for work in self.inner:
            work.wait()
        self.done = True
        for tensor, before in self.watched:
            if not torch.equal(_bytes(tensor), before):
                raise InputChangedBeforeWait(
                    f"the input of an asynchronous {self.name} was written before its "
                    "wait(): on nccl the collective may still be reading it")
        self.deliver()
        return True

    def is_completed(self) -> bool:
        return self.done

    def is_success(self) -> bool:
        return self.done

    def get_future(self):
        self.wait()
        future = torch.futures.Future()
        future.set_result(None)
        return future


class NcclFaithfulGroup(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, name: str):
        super().__init__(rank, size)
        self._name = name
        self.inner = dist.ProcessGroupGloo(dist.PrefixStore("inner/", store), rank, size,
                                           timeout)

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:  # torch does not name a Python group's C++ side
        return self._name

    # -- the one pattern every collective follows ------------------------------------------
    def _issue(self, name, launch, outputs, inputs, keep=()):
        """Run ``launch(private_outputs, private_inputs)`` on copies; poison ``outputs`` (but
        ``keep``, what nccl does not write) until wait(); watch inputs not in outputs."""
        # .data: written as a collective writes, without autograd's version counter (a saved
        # tensor written by an all-gather is not "modified in place" on gloo or nccl)
        outputs = [t.data for t in outputs]
        keep = [t.data for t in keep]
        private_in = _private(inputs)
        private_out = [torch.empty(t.shape, dtype=t.dtype) for t in outputs]
        works = launch(private_out, private_in)
        kept = [(t, t.detach().clone()) for t in keep]
        for t in outputs:
            poison(t)
        for t, value in kept:
            t.copy_(value)
        watched = [t for t in inputs if not any(_shares_memory(t, o) for o in outputs)]

        def deliver():
            for t, value in zip(outputs, private_out):
                t.copy_(value)
        return _Pending(name, works if isinstance(works, list) else [works], deliver, watched)

    # -- collectives ---------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        def launch(out, inp):
            work = self.inner.allreduce(inp, opts) if opts is not None \
                else self.inner.allreduce(inp)
            out[:] = inp  # reduced in place into the private copies
            return work
        return self._issue("all-reduce", launch, tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        def launch(out, inp):
            work = self.inner.allreduce_coalesced(inp, opts)
            out[:] = inp
            return work
        return self._issue("all-reduce", launch, tensors, tensors)

    def broadcast(self, tensors, opts):
        root = self.rank() == opts.rootRank

        def launch(out, inp):
            work = self.inner.broadcast(inp, opts)
            out[:] = inp
            return work
        # nccl leaves the root's buffer as it is: only its being written to is a race
        return self._issue("broadcast", launch, tensors, tensors, keep=tensors if root else ())

    def allgather(self, output_lists, inputs, opts=None):
        flat = [t for outs in output_lists for t in outs]

        def launch(out, inp):
            it = iter(out)
            nested = [[next(it) for _ in outs] for outs in output_lists]
            return self.inner.allgather(nested, inp, opts)
        return self._issue("all-gather", launch, flat, inputs, keep=inputs)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002 - torch's names
        def launch(out, inp):
            return self.inner._allgather_base(out[0], inp[0], opts)
        # an in-place all-gather's own chunk (input is a view of output) is left as it was
        return self._issue("all-gather", launch, [output], [input], keep=[input])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        def launch(out, inp):
            return [self.inner._allgather_base(o, i, opts) for o, i in zip(out, inp)]
        return self._issue("all-gather", launch, outputs, inputs, keep=inputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        flat = [t for ins in input_lists for t in ins]

        def launch(out, inp):
            it = iter(inp)
            nested = [[next(it) for _ in ins] for ins in input_lists]
            return self.inner.reduce_scatter(out, nested, opts)
        return self._issue("reduce-scatter", launch, outputs, flat)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        def launch(out, inp):
            return self.inner._reduce_scatter_base(out[0], inp[0], opts)
        return self._issue("reduce-scatter", launch, [output], [input])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        def launch(out, inp):
            return [self.inner._reduce_scatter_base(o, i, opts) for o, i in zip(out, inp)]
        return self._issue("reduce-scatter", launch, outputs, inputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                      opts=None):
        def launch(out, inp):
            return self.inner.alltoall_base(out[0], inp[0], output_split_sizes,
                                            input_split_sizes, opts)
        return self._issue("all-to-all", launch, [output], [input])

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        def launch(out, inp):
            return self.inner.alltoall(out, inp, opts)
        return self._issue("all-to-all", launch, outputs, inputs)

    # -- point to point: nccl matches by order only, so every tag is the same -------------
    def send(self, tensors, dst, tag):  # noqa: ARG002
        return self._issue("send", lambda out, inp: self.inner.send(inp, dst, 0), [], tensors)

    def recv(self, tensors, src, tag):  # noqa: ARG002
        return self._issue("receive", lambda out, inp: self.inner.recv(out, src, 0),
                           tensors, [])

    # -- the rest runs as gloo runs it -----------------------------------------------------
    def barrier(self, opts=None):
        return self.inner.barrier(opts) if opts is not None else self.inner.barrier()

    def gather(self, outputs, inputs, opts):
        return self.inner.gather(outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts):
        return self.inner.scatter(outputs, inputs, opts)

    def reduce(self, tensors, opts):
        return self.inner.reduce(tensors, opts)


def _create(options, _backend_options):
    return NcclFaithfulGroup(options.store, options.group_rank, options.group_size,
                             options.timeout, options.group_id)


def register() -> None:
    """Make ``init_process_group(BACKEND)`` and ``new_group(backend=BACKEND)`` known."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
