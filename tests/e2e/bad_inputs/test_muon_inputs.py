"""Bad Muon settings (--optimizer muon) and MuonClip's (--qk-clip), as a user types them: one
``error:`` line naming the flag and the fix, exit 2, no traceback, no iteration."""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import LLAMA, TINY

MUON = ["--optimizer", "muon"]
CASES = [
    ("momentum-without-muon", ["--muon-momentum", "0.9"],
     ["--muon-momentum has no effect without --optimizer muon"]),
    ("momentum-one", MUON + ["--muon-momentum", "1"],
     ["--muon-momentum must be in [0, 1), got 1.0"]),
    ("zero-ns-steps", MUON + ["--muon-num-ns-steps", "0"],
     ["--muon-num-ns-steps must be >= 1, got 0"]),
    ("zero-extra-scale", MUON + ["--muon-extra-scale-factor", "0"],
     ["--muon-extra-scale-factor must be > 0, got 0.0"]),
    ("blockwise-tp-mode", MUON + ["--muon-tp-mode", "blockwise"],
     ["--muon-tp-mode blockwise orthogonalizes each TP shard alone",
      "use --muon-tp-mode duplicated"]),
    ("distributed-tp-mode", MUON + ["--muon-tp-mode", "distributed"],
     ["--muon-tp-mode 'distributed' is not built", "use --muon-tp-mode duplicated"]),
    ("overlapped-distributed-optimizer", MUON + ["--overlapped-distributed-optimizer"],
     ["--optimizer muon with --overlapped-distributed-optimizer is not built yet",
      "use --use-distributed-optimizer"]),
    ("cpu-offload", MUON + ["--optimizer-cpu-offload"],
     ["--optimizer muon with --optimizer-cpu-offload is not built yet"]),
    ("fsdp2", MUON + ["--use-torch-fsdp2"],
     ["--use-torch-fsdp2 with --optimizer muon is not built yet"]),
    ("qk-clip-threshold-without-qk-clip", MUON + ["--qk-clip-threshold", "50"],
     ["--qk-clip-threshold has no effect without --qk-clip: add --qk-clip"]),
    ("qk-clip-alpha-without-qk-clip", ["--qk-clip-alpha", "0.3"],
     ["--qk-clip-alpha has no effect without --qk-clip"]),
    ("qk-clip-zero-threshold", MUON + ["--qk-clip", "--qk-clip-threshold", "0"],
     ["--qk-clip-threshold must be > 0, got 0.0"]),
    ("qk-clip-alpha-above-one", MUON + ["--qk-clip", "--qk-clip-alpha", "1.5"],
     ["--qk-clip-alpha must be in [0, 1], got 1.5"]),
    ("qk-clip-with-qk-layernorm", MUON + ["--qk-clip", "--qk-layernorm"],
     ["--qk-clip rescales rows of W_q and W_k, which --qk-layernorm's norms",
      "drop one of them"]),
]


@pytest.mark.parametrize("extra,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_muon_setting(extra, fragments):
    assert_clean_error(run("pretrain_llama.py", TINY + LLAMA + extra), 2, *fragments)
