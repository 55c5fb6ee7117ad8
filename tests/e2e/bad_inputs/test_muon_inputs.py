"""Bad Muon settings (--optimizer muon), as a user types them: one ``error:`` line naming the
flag and the fix, exit 2, no traceback, no iteration."""
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
]


@pytest.mark.parametrize("extra,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_muon_setting(extra, fragments):
    assert_clean_error(run("pretrain_llama.py", TINY + LLAMA + extra), 2, *fragments)
