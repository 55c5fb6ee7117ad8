"""W&B logging without a server: the logger's scalar sink gives every writer what TensorBoard
gets (read back from disk), WandbWriter's rows and axes, the exit code a finished run gets,
the online/offline decision (key, network probe, WANDB_MODE), and the error line when wandb
is missing."""
import socket
import threading

import numpy as np
import pytest

from megatron.training.arguments import ConfigError, build_configs, parse_args
from megatron.training.logging import wandb_log
from megatron.training.logging.timers import Timers
from megatron.training.logging.wandb_log import (
    WandbWriter,
    choose_mode,
    has_api_key,
    resolve_save_dir,
    server_reachable,
    wandb_missing_reason,
)
from tests.unit.test_training_log import FakeClock, _logger, _read_scalars

LOSSES = {1: 7.1, 2: 6.9, 3: 6.7, 4: 6.5}


class Recorder:
    """A writer that keeps every add_scalar call, as TensorBoard's file would."""

    def __init__(self):
        self.calls, self.closed = [], False

    def add_scalar(self, tag, value, step):
        self.calls.append((tag, step, value))

    def flush(self):
        pass

    def close(self):
        self.closed = True


class FakeRun:
    """The part of wandb's Run that WandbWriter uses."""

    def __init__(self):
        self.metrics, self.rows, self.exit_code = {}, [], None

    def define_metric(self, name, step_metric=None):
        self.metrics[name] = step_metric

    def log(self, row):
        self.rows.append(dict(row))

    def finish(self, exit_code=None):
        self.exit_code = exit_code


def _drive(tmp_path, writers):
    """Four iterations, timers and a validation through a logger that also writes
    TensorBoard to tmp_path; returns TensorBoard's scalars as read back from disk."""
    clock = FakeClock()
    timers = Timers(log_level=0, clock=clock)
    logger, _, _ = _logger(
        log_interval=2, clock=clock, timers=timers, tensorboard_dir=str(tmp_path),
        log_timers_to_tensorboard=True, log_batch_size_to_tensorboard=True,
        log_validation_ppl_to_tensorboard=True, writers=writers)
    logger.start()
    for it, loss in LOSSES.items():
        timers("forward-backward", log_level=0).start()
        clock.t += 0.25 * it
        timers("forward-backward").stop()
        clock.t += 0.5
        logger.training_log(it, {"lm loss": loss}, 1e-4 * it, 1.0, grad_norm=0.25 * it,
                            num_zeros=float(it), consumed_samples=8 * it)
    logger.log_validation(4, {"lm loss": 6.4}, consumed_samples=32)
    logger.close()
    return _read_scalars(tmp_path)


def _by_tag(triples):
    out = {}
    for tag, step, value in triples:
        out.setdefault(tag, []).append((step, float(np.float32(value))))
    return out


def test_every_writer_gets_the_tensorboard_scalars(tmp_path):
    recorder = Recorder()
    tensorboard = _drive(tmp_path, [recorder])
    assert _by_tag(recorder.calls) == tensorboard  # same tags, steps and (float32) values
    assert {"lm loss", "lm loss vs samples", "forward-backward-time", "iteration-time", "mfu",
            "lm loss validation ppl", "batch-size"} <= set(tensorboard)
    assert recorder.closed


def _wandb_scalars(run):
    """The rows as TensorBoard would have them: each tag against its axis."""
    triples = []
    for row in run.rows:
        for tag, value in row.items():
            if tag not in ("iteration", "samples"):
                triples.append((tag, row[run.metrics[tag]], value))
    return _by_tag(triples)


def test_wandb_writer_logs_the_tensorboard_scalars_one_row_per_iteration(tmp_path):
    run = FakeRun()
    tensorboard = _drive(tmp_path, [WandbWriter(run)])
    assert _wandb_scalars(run) == tensorboard
    assert [row["iteration"] for row in run.rows] == [1, 2, 3, 4]  # validation joins row 4
    assert [row["samples"] for row in run.rows] == [8, 16, 24, 32]
    assert run.metrics["lm loss"] == "iteration"
    assert run.metrics["lm loss vs samples"] == "samples"
    assert run.metrics["iteration"] is None and run.metrics["samples"] is None
    assert run.rows[3]["lm loss validation"] == 6.4
    assert run.exit_code == 0


def test_a_row_is_sent_when_one_of_its_axes_moves():
    run = FakeRun()
    writer = WandbWriter(run)
    writer.add_scalar("lm loss", 2.0, 5)
    writer.add_scalar("lm loss vs samples", 2.0, 40)
    writer.add_scalar("lm loss validation vs samples", 1.5, 48)  # other samples: new row
    writer.add_scalar("lm loss", 1.0, 6)  # joins it: that row has no iteration yet
    writer.add_scalar("grad-norm", 0.5, 6)
    writer.add_scalar("lm loss", 0.5, 7)
    writer.flush()
    assert run.rows == [{"lm loss": 2.0, "iteration": 5, "lm loss vs samples": 2.0,
                         "samples": 40},
                        {"lm loss validation vs samples": 1.5, "samples": 48, "lm loss": 1.0,
                         "iteration": 6, "grad-norm": 0.5},
                        {"lm loss": 0.5, "iteration": 7}]


@pytest.mark.parametrize("raised, code", [(None, 0), (SystemExit(2), 2), (SystemExit(None), 0),
                                          (RuntimeError("x"), 1), (KeyboardInterrupt(), 1)])
def test_the_run_finishes_with_the_exit_code_in_flight(raised, code):
    run = FakeRun()
    writer = WandbWriter(run)
    writer.add_scalar("lm loss", 3.0, 1)
    try:
        if raised is not None:
            raise raised
    except BaseException:
        writer.close()
    else:
        writer.close()
    assert run.exit_code == code
    assert run.rows == [{"lm loss": 3.0, "iteration": 1}]  # the pending row is sent first


def _connect_counting(calls, fail):
    def connect(address, timeout=None):
        calls.append((address, timeout))
        if fail:
            raise OSError("Name or service not known")
        return socket.socket()  # closed at once by the probe
    return connect


def test_wandb_mode_set_leaves_the_choice_to_wandb(monkeypatch):
    calls = []
    monkeypatch.setattr(socket, "create_connection", _connect_counting(calls, fail=False))
    assert choose_mode({"WANDB_MODE": "online"}, key_found=lambda host: False) == (None, None)
    assert calls == []  # no probe at all


def test_no_api_key_is_offline_without_touching_the_network(monkeypatch):
    calls = []
    monkeypatch.setattr(socket, "create_connection", _connect_counting(calls, fail=False))
    mode, why = choose_mode({}, key_found=lambda host: False)
    assert mode == "offline" and "no W&B API key" in why
    assert calls == []


def test_unreachable_server_is_offline(monkeypatch):
    calls = []
    monkeypatch.setattr(socket, "create_connection", _connect_counting(calls, fail=True))
    mode, why = choose_mode({"WANDB_BASE_URL": "https://wandb.example.org:8443"},
                            key_found=lambda host: host == "wandb.example.org")
    assert (mode, why) == ("offline", "wandb.example.org:8443 did not answer within 1.5 s")
    assert calls == [(("wandb.example.org", 8443), 1.5)]


def test_reachable_server_with_a_key_is_online(monkeypatch):
    calls = []
    monkeypatch.setattr(socket, "create_connection", _connect_counting(calls, fail=False))
    assert choose_mode({}, key_found=lambda host: True) == ("online", None)
    assert calls == [(("api.wandb.ai", 443), 1.5)]


def test_a_probe_that_never_returns_counts_as_unreachable(monkeypatch):
    never = threading.Event()

    def hang(*args, **kwargs):
        never.wait()
        raise OSError("timed out")

    monkeypatch.setattr(socket, "create_connection", hang)
    try:
        assert server_reachable("api.wandb.ai", 443, timeout=0.05) is False
    finally:
        never.set()  # let the daemon thread end


def test_api_key_from_environment_or_netrc(tmp_path):
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    netrc_file.chmod(0o600)
    missing = str(tmp_path / "none")
    assert has_api_key("api.wandb.ai", {"NETRC": str(netrc_file)})
    assert not has_api_key("wandb.example.org", {"NETRC": str(netrc_file)})
    assert has_api_key("api.wandb.ai", {"NETRC": missing, "WANDB_API_KEY": "k"})
    assert not has_api_key("api.wandb.ai", {"NETRC": missing})


def test_save_dir_defaults_like_megatron():
    assert resolve_save_dir("/runs/wb", "/ckpt") == "/runs/wb"
    assert resolve_save_dir(None, "/ckpt") == "/ckpt/wandb"
    assert resolve_save_dir(None, None) == "wandb"


TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
        "--train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 64").split()


def test_missing_wandb_is_a_config_error_naming_the_fix(monkeypatch):
    monkeypatch.setattr(wandb_log.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else object())
    with pytest.raises(ConfigError, match=r"--wandb-project needs the wandb package.*"
                                          r"pip install wandb"):
        build_configs(parse_args(TINY + ["--wandb-project", "p"]))
    build_configs(parse_args(TINY))  # without the flag wandb is never looked for
    assert wandb_missing_reason(None) is None


def test_missing_wandb_stops_pretrain_with_one_error_line(monkeypatch, capsys):
    from megatron.training.pretrain import _configs_or_exit

    monkeypatch.setattr(wandb_log.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else object())
    with pytest.raises(SystemExit) as stop:
        _configs_or_exit(TINY + ["--wandb-project", "p"])
    assert stop.value.code == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --wandb-project needs the wandb")
    assert "pip install wandb" in lines[0]
