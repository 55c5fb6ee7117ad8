"""W&B offline runs read back: a tiny pretraining run with TensorBoard and W&B both on, then
the .wandb file (wandb's own records) holds the values TensorBoard and the console hold.
No network here: one run decides offline by itself (WANDB_MODE unset, no API key), the other
is told (WANDB_MODE=offline) and runs with two pipeline stages (only the last rank logs)."""
import os
import re

import numpy as np
import pytest

pytest.importorskip("wandb")  # optional (--wandb-project only): reading its records needs it

from tests.e2e.bad_inputs.harness import run as run_forked  # noqa: E402
from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script, without  # noqa: E402
from tests.wandb_records import (  # noqa: E402
    history_rows,
    records,
    run_config,
    run_files,
    run_record,
    scalars,
)


def _tensorboard(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def _as_float32(pairs):
    return [(step, float(np.float32(value))) for step, value in pairs]


def test_offline_run_holds_the_tensorboard_and_console_values(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no key: offline, no probe
    wandb_dir, tb_dir = tmp_path / "wb", tmp_path / "tb"
    flags = TINY + LLAMA + ["--tensorboard-dir", str(tb_dir), "--wandb-project", "p",
                            "--wandb-save-dir", str(wandb_dir),
                            "--log-validation-ppl-to-tensorboard"]
    proc = run_script("pretrain_llama.py", flags)
    losses, valid = parse_losses(proc)
    [path] = run_files(str(wandb_dir))
    notice = re.findall(r"^wandb: logging offline \(no W&B API key.*wandb sync (\S+)$",
                        proc.stdout, re.M)
    assert notice == [os.path.dirname(path)], proc.stdout[-2000:]
    rows = history_rows(path)
    tensorboard = _tensorboard(tb_dir)
    tags = {tag for row in rows for tag in row} - {"iteration", "samples"}
    assert tags == set(tensorboard), (tags, set(tensorboard))
    for tag, logged in tensorboard.items():
        axis = "samples" if tag.endswith(" vs samples") else "iteration"
        assert _as_float32(scalars(rows, tag, axis)) == logged, tag
    trained = scalars(rows, "lm loss")
    assert [step for step, _ in trained] == list(range(1, 7))
    for (_, got), printed in zip(trained, losses, strict=True):
        assert abs(got - printed) <= 1e-6 * abs(printed)  # printed with 7 digits
    validation = scalars(rows, "lm loss validation")
    assert [step for step, _ in validation] == [3, 6]
    for (_, got), printed in zip(validation, valid, strict=True):
        assert abs(got - printed) <= 1e-6 * abs(printed)
    assert run_config(path)["num_layers"] == 4 and run_config(path)["wandb_project"] == "p"


def test_last_pipeline_stage_logs_under_save_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    save = tmp_path / "ckpt"
    flags = without(TINY, "--eval-interval") + LLAMA + [
        "--eval-interval", "6", "--pipeline-model-parallel-size", "2", "--save", str(save),
        "--wandb-project", "p", "--wandb-exp-name", "pp2-run"]
    proc = run_script("pretrain_llama.py", flags, nproc=2)
    losses, _ = parse_losses(proc)
    [path] = run_files(str(save / "wandb"))  # Megatron's default: <--save>/wandb
    assert "wandb: logging offline (WANDB_MODE)" in proc.stdout
    rows = history_rows(path)
    trained = scalars(rows, "lm loss")  # only the last stage has the loss
    assert [step for step, _ in trained] == list(range(1, 7))
    for (_, got), printed in zip(trained, losses, strict=True):
        assert abs(got - printed) <= 1e-6 * abs(printed)
    assert run_record(path).display_name == "pp2-run"  # --wandb-exp-name names the run
    config = run_config(path)
    assert config["wandb_exp_name"] == "pp2-run"
    assert config["pipeline_model_parallel_size"] == 2


def test_an_error_exit_still_finishes_the_run_as_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MEGATRON_FAULT_INJECTION", "nan:0:2-4")  # NaN guard stops after 4
    flags = TINY + LLAMA + ["--wandb-project", "p", "--wandb-save-dir", str(tmp_path)]
    proc = run_forked("pretrain_llama.py", flags)  # a failing run: not the warm pool's
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    [path] = run_files(str(tmp_path))
    exits = [r.exit.exit_code for r in records(path) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]
    assert [step for step, _ in scalars(history_rows(path), "grad-norm")] == [1, 2, 3, 4]
