"""shtools/launch/multi_node.sh with MASTER_PORT taken on the rendezvous host: one error line
and exit 2 before torchrun starts (it would wait for that port's program forever); the port
free, or taken by this job's own store (another "node" of the same job on this machine), the
launch goes on. TORCHRUN=echo stands in for the launcher: nothing trains."""
import os
import socket
import subprocess
import uuid

from tests.e2e.bad_inputs.harness import assert_clean_error
from tests.e2e.runner import ROOT


def _launch(port: int, job: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NNODES="2", GPUS_PER_NODE="1", MASTER_ADDR="localhost",
               MASTER_PORT=str(port), JOB_ID=job, TORCHRUN="echo", TMPDIR=str(tmp_path),
               CONFIG="shtools/configs/gpt_small.sh")
    return subprocess.run(["bash", "shtools/launch/multi_node.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_master_port_in_use_is_one_line(tmp_path):
    job = f"job-{uuid.uuid4().hex[:8]}"
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        proc = _launch(port, job, tmp_path)
        assert_clean_error(proc, 2, f"MASTER_PORT {port} on localhost is already in use",
                           "set MASTER_PORT to a free port on every node")
        assert proc.stdout == ""  # the launcher never ran
    # Free: the launch goes on (and marks the port as this job's).
    free = _launch(port, job, tmp_path)
    assert free.returncode == 0 and f"--rdzv-endpoint localhost:{port}" in free.stdout
    with socket.socket() as store:  # this job's own store, as a second "node" finds it
        store.bind(("", port))
        store.listen()
        second = _launch(port, job, tmp_path)
    assert second.returncode == 0 and "--rdzv-id " + job in second.stdout
