"""Parallelism planner: which TP / CP / PP / VPP / DP / micro batch / recomputation / optimizer
sharding to use for a model on a cluster, from the memory estimate (``memory.estimate``)
and a step-time model (``step_time``). ``tools/plan_parallelism.py`` is its command line."""
from megatron.training.planner.layouts import Layout
from megatron.training.planner.plan import Plan, PlanRow, plan
from megatron.training.planner.step_time import Cluster, StepTime, estimate_step_time
from megatron.training.planner.workload import Workload, workload_from_flags

__all__ = ["Cluster", "Layout", "Plan", "PlanRow", "StepTime", "Workload", "estimate_step_time",
           "plan", "workload_from_flags"]
