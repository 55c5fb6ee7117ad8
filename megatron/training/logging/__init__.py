"""What a run reports: Megatron's console line and scalars to TensorBoard and W&B, timers,
FLOPs and MFU, the MoE layers' metrics, and pipeline traces and timelines.

    training_log.py       the console line and every writer's scalars (ScalarWriters)
    deferred.py           the loop's reports kept on the device, read once per log interval
    wandb_log.py          Weights & Biases (--wandb-project), offline without network
    timers.py             Megatron's named timers (--timing-log-level)
    flops.py              model FLOPs per iteration and MFU, Megatron's accounting
    moe_metrics.py        per-layer aux/z losses and expert load
    pipeline_tracing.py   --pipeline-trace-dir: one iteration's schedule, per rank
    pipeline_timeline.py  traces or a simulated schedule as rows of bars (tools/plot_pipeline.py)

Only ``megatron.training.logging`` names this package: ``import logging`` anywhere still
means the standard library's (imports are absolute).
"""
