"""Per-rank memory of a training configuration, before anything is allocated.

    estimate.py     ``estimate_memory`` / ``format_report``: the report pretrain() prints
    params.py       parameters, gradients and optimizer state (exact for this code base)
    activations.py  what autograd keeps per layer and per pipeline stage
    schedules.py    the zero-bubble schedules' deferred weight-gradient inputs
    moe.py          the mixture-of-experts terms
    modes.py        ZeRO-2, FSDP2 and CPU offload; rank_state_bytes (one rank's state)
    base.py         the dataclasses they share (ParamShape, OptimizerSetup, ModelStateBytes)

Imports run one way: base <- moe <- params <- {modes, schedules}; schedules, params, moe <-
activations; activations, modes <- estimate.
"""
