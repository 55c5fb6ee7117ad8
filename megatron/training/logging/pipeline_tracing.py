"""``--pipeline-trace-dir``: record what the pipeline schedule did on one training iteration.

On iteration ``--pipeline-trace-iteration`` every rank records a ``PipelineTrace`` of its
forward, backward and communication-wait steps and writes ``DIR/trace_rank{rank:05d}.json``;
``tools/plot_pipeline.py DIR`` draws them. Every other iteration runs untraced (no cost).

Besides the events, a file holds: rank (global), pipeline_rank, tensor_rank, data_rank,
world_size, pipeline_size, virtual_size (null without interleaving), num_microbatches,
iteration, run_id (the same on every rank of one run) and clock_origin (see trace.py).
"""
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.pipeline_parallel.trace import PipelineTrace


def trace_file_name(rank: int) -> str:
    return f"trace_rank{rank:05d}.json"


def start_trace(iteration: int, training_config, num_microbatches: int
                ) -> Optional[PipelineTrace]:
    """A trace for this iteration if it is the one asked for, else None. Called by every rank:
    it holds them until all arrive, so the traced schedule starts together everywhere."""
    t = training_config
    if t.pipeline_trace_dir is None or iteration != t.pipeline_trace_iteration:
        return None
    # The all-reduce is the barrier, and its result (the last rank's arrival time) is the
    # same on every rank: it tells the traces of one run apart from those of another.
    arrival = device.tensor([time.time()], dtype=torch.float64)
    dist.all_reduce(arrival, op=dist.ReduceOp.MAX)
    return PipelineTrace(
        rank=dist.get_rank(), pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
        info={"run_id": f"{arrival.item():.6f}", "iteration": iteration,
              "world_size": dist.get_world_size(),
              "tensor_rank": parallel_state.get_tensor_model_parallel_rank(),
              "data_rank": parallel_state.get_data_parallel_rank(),
              "pipeline_size": parallel_state.get_pipeline_model_parallel_world_size(),
              "virtual_size": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
              "num_microbatches": num_microbatches})


def finish_trace(trace: Optional[PipelineTrace], training_config) -> None:
    if trace is None:
        return
    path = os.path.join(training_config.pipeline_trace_dir, trace_file_name(trace.rank))
    trace.write(path)
    if trace.rank == 0:
        print(f"pipeline trace of iteration {trace.info['iteration']} written to "
              f"{training_config.pipeline_trace_dir} (draw it with: python3 "
              f"tools/plot_pipeline.py {training_config.pipeline_trace_dir} --out FILE.png)",
              flush=True)
