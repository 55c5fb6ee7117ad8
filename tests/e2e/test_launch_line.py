"""The issue's Megatron-LLaMA launch line (tests/unit/test_arguments.py LAUNCH), every flag kept,
with the sizes scaled down, run with torchrun on 2 CPU processes (TP=2, sequence parallel, bf16,
overlapped distributed optimizer, selective recomputation) on real data: three blended datasets
made by tools/preprocess_data.py with a Hugging Face tokenizer directory."""
import math
import shlex

from tests.e2e.runner import parse_iterations, parse_losses, run_script
from tests.unit.test_arguments import LAUNCH

TRAIN_ITERS = 4
SCALED_DOWN = {
    "--num-layers": 2, "--hidden-size": 32, "--num-attention-heads": 4, "--ffn-hidden-size": 64,
    "--seq-length": 32, "--max-position-embeddings": 32, "--micro-batch-size": 2,
    "--global-batch-size": 4, "--train-iters": TRAIN_ITERS, "--eval-interval": 2,
    "--eval-iters": 1, "--save-interval": 2, "--lr-warmup-iters": 1,
    "--lr-decay-iters": TRAIN_ITERS,
    # 6e-5 fine-tunes a 13B model; a tiny one from scratch needs more to move in 4 steps.
    "--lr": 1e-2, "--min-lr": 1e-3,
}


def scaled_down(argv, values):
    """``argv`` with the value after each flag in ``values`` replaced; every flag must occur."""
    out, seen = list(argv), set()
    for i, flag in enumerate(argv):
        if flag in values:
            out[i + 1] = str(values[flag])
            seen.add(flag)
    assert seen == set(values), set(values) - seen
    return out


def test_megatron_llama_launch_line_on_real_data(quickstart_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    checkpoints, tensorboard = tmp_path / "checkpoints", tmp_path / "tensorboard"
    argv = scaled_down(shlex.split(LAUNCH.format(
        d=quickstart_data.data, tok=quickstart_data.tokenizer, ck=checkpoints,
        tb=tensorboard)), SCALED_DOWN)
    assert argv.count("--data-path") == 1 and "--bf16" in argv and "--finetune" in argv
    proc = run_script("pretrain_llama.py", argv, nproc=2)
    losses, valid = parse_losses(proc)

    assert [i for i, _, _ in parse_iterations(proc)] == list(range(1, TRAIN_ITERS + 1))
    assert len(losses) == TRAIN_ITERS and len(valid) == TRAIN_ITERS // 2
    assert all(math.isfinite(x) for x in losses + valid), (losses, valid)
    # --init-method-std 0.01 gives near-zero logits: a uniform guess over the vocabulary.
    assert abs(losses[0] - math.log(quickstart_data.vocab_size)) < 0.2, losses
    assert losses[-1] < losses[0] - 0.1, losses  # it learns, even in bf16
    events = EventAccumulator(str(tensorboard))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == list(range(1, TRAIN_ITERS + 1))
    assert {"lm loss validation", "lm loss validation ppl", "batch-size"} <= set(
        events.Tags()["scalars"])
    # --save-interval 2 and the end of training; Megatron's directory layout.
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (checkpoints / "iter_0000002").is_dir() and (checkpoints / "iter_0000004").is_dir()
