"""Weights & Biases logging: Megatron's ``--wandb-project``, ``--wandb-exp-name`` and
``--wandb-save-dir``.

As in Megatron, the last rank opens one W&B run (named by ``--wandb-exp-name``, its files under
``--wandb-save-dir``, by default ``<--save>/wandb``, else ``./wandb``; the run config is the
parsed flags) and logs the scalars the TensorBoard writer logs: ``TrainingLogger`` writes
``add_scalar(tag, value, step)`` to every writer alike, and ``WandbWriter`` is one of them.

``wandb`` is imported only when a run is opened. Without ``WANDB_MODE`` the mode is decided
here, without waiting on the network: online only with an API key and api.wandb.ai (or
``WANDB_BASE_URL``) reachable within ``PROBE_SECONDS``; otherwise offline, with one line on
how to upload the run later (``wandb sync DIR``).
"""
import importlib
import importlib.util
import netrc
import os
import socket
import sys
import threading
from typing import Callable, Dict, Optional, Tuple
from urllib.parse import urlparse

DEFAULT_BASE_URL = "https://api.wandb.ai"
PROBE_SECONDS = 1.5  # the longest a run waits to learn whether W&B's server answers
ITERATION_AXIS, SAMPLES_AXIS = "iteration", "samples"
SAMPLES_SUFFIX = " vs samples"  # TensorBoard's tags whose step is consumed samples


def wandb_missing_reason(project: Optional[str]) -> Optional[str]:
    """Why ``--wandb-project`` cannot work here (wandb not installed, or not importable), else
    None. Checked at start, so that the run stops before a step rather than when the last rank
    opens the run."""
    if not project:
        return None
    if importlib.util.find_spec("wandb") is None:
        return ("--wandb-project needs the wandb package, which is not installed: "
                "pip install wandb (or drop --wandb-project).")
    try:  # found but broken (a partial install, a missing dependency of its own)
        importlib.import_module("wandb")
    except ImportError as e:
        return (f"--wandb-project needs the wandb package, which does not import here "
                f"({' '.join(str(e).split())}): pip install wandb "
                f"(or drop --wandb-project).")
    return None


def resolve_save_dir(wandb_save_dir: Optional[str], save: Optional[str]) -> str:
    """Megatron's default: ``<--save>/wandb``; without --save, ``./wandb``."""
    if wandb_save_dir:
        return wandb_save_dir
    return os.path.join(save, "wandb") if save else "wandb"


def _server_host(environ) -> Tuple[str, int]:
    url = urlparse(environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL)
    return url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)


def has_api_key(host: str, environ=os.environ) -> bool:
    """An API key wandb would find without asking: WANDB_API_KEY or a netrc entry (what
    ``wandb login`` writes). Without one, an online run would prompt and wait."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        return netrc.netrc(environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def server_reachable(host: str, port: int, timeout: float = PROBE_SECONDS) -> bool:
    """A TCP connect to the server within ``timeout``, name lookup included (it runs in a
    thread: a lookup with no DNS server may otherwise block far longer)."""
    answered = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def choose_mode(environ=os.environ,
                key_found: Callable[[str], bool] = None,
                reachable: Callable[[str, int], bool] = server_reachable
                ) -> Tuple[Optional[str], Optional[str]]:
    """(mode for wandb.init, or None to leave it to WANDB_MODE; why offline, or None)."""
    if environ.get("WANDB_MODE"):
        return None, None
    host, port = _server_host(environ)
    if not (key_found or (lambda h: has_api_key(h, environ)))(host):
        return "offline", "no W&B API key (WANDB_API_KEY or `wandb login`)"
    if not reachable(host, port):
        return "offline", f"{host}:{port} did not answer within {PROBE_SECONDS} s"
    return "online", None


class WandbWriter:
    """TensorBoard's ``add_scalar(tag, value, step)`` onto a W&B run.

    W&B's own step may only grow, while TensorBoard's steps are iterations for most tags and
    consumed samples for the ``' vs samples'`` ones; so each tag is plotted against a logged
    axis instead (``iteration`` or ``samples``, W&B's define_metric), and the scalars of one
    iteration go out as one row (sent when the next iteration starts, or at flush)."""

    def __init__(self, run):
        self.run = run
        self._row: Dict[str, float] = {}
        self._axes: Dict[str, int] = {}  # the pending row's axis values
        self._defined = set()
        for axis in (ITERATION_AXIS, SAMPLES_AXIS):
            run.define_metric(axis)

    def add_scalar(self, tag: str, value, step: int) -> None:
        axis = SAMPLES_AXIS if tag.endswith(SAMPLES_SUFFIX) else ITERATION_AXIS
        if self._axes.get(axis, step) != step:
            self.flush()
        if tag not in self._defined:
            self.run.define_metric(tag, step_metric=axis)
            self._defined.add(tag)
        self._axes[axis] = int(step)
        self._row[tag] = float(value)

    def flush(self) -> None:
        if self._row:
            self.run.log({**self._row, **self._axes})
        self._row, self._axes = {}, {}

    def close(self) -> None:
        """Send the last row and finish the run; called from ``finally`` blocks, so an
        exception in flight (an error exit's SystemExit included) marks the run failed."""
        self.flush()
        self.run.finish(exit_code=_exit_code_in_flight())


def _exit_code_in_flight() -> int:
    exc = sys.exc_info()[1]
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 1


def open_wandb_writer(project: str, exp_name: Optional[str], save_dir: str, config: dict,
                      print_fn: Callable[[str], None] = print) -> WandbWriter:
    """Start the run (the last rank's only); offline where the network or a key is missing."""
    import wandb

    os.makedirs(save_dir, exist_ok=True)
    mode, why_offline = choose_mode()
    kwargs = dict(project=project, name=exp_name, dir=save_dir, config=config,
                  settings=wandb.Settings(console="off", silent=True))
    try:
        run = wandb.init(**kwargs, **({"mode": mode} if mode else {}))
    except Exception as exc:  # noqa: BLE001 - a login or server failure must not stop training
        if mode == "offline":
            raise
        why_offline = f"wandb.init failed online ({type(exc).__name__}: {exc})"
        run = wandb.init(**kwargs, mode="offline")
    if run.offline:
        sync_dir = os.path.dirname(run.dir.rstrip(os.sep))  # run.dir is <run>/files
        print_fn(f"wandb: logging offline ({why_offline or 'WANDB_MODE'}); "
                 f"upload later with: wandb sync {sync_dir}")
    return WandbWriter(run)
