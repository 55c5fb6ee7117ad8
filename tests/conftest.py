"""Session settings for every tier. The unit and e2e tiers are CPU tests (gloo, fp32, bitwise
references): they run on CPU even on a machine with a GPU, unless MEGATRON_DEVICE says
otherwise. Without this, rank pools small enough to get a GPU each and the in-process code
would pick CUDA (and nccl) while other pools and references stay on CPU. The GPU tier
(tests/gpu) sets its own device for its modules (tests/gpu/conftest.py)."""
import os

os.environ.setdefault("MEGATRON_DEVICE", "cpu")
