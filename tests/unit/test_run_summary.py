"""What a run prints about itself: the start block (layout, the model's parameters counted
once whatever the layout, batch, data, precision, where checkpoints go), the first iteration
logged whatever --log-interval, a validation after training when the interval never came, and
the closing line (its losses are the last logged ones)."""
import re

from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script, without



def tiny_llama_parameters(padded_vocab):
    """TINY + LLAMA by hand: 4 layers of (2 norms 32 + QKV 32 x 96 + projection 32 x 32 +
    fc1 32 x 96 + fc2 48 x 32) = 4 x 8768, the embedding and the untied output layer
    padded_vocab x 32 each (64 ids padded to a multiple of 128 x TP), the final norm 32."""
    return 4 * 8768 + 2 * padded_vocab * 32 + 32


FLAGS = without(TINY, "--log-interval", "--eval-interval") + LLAMA + [
    "--log-interval", "4", "--eval-interval", "100"]


def _total(stdout):
    return int(re.search(r"^model: ([\d,]+) ", stdout, re.M).group(1).replace(",", ""))


def test_start_block_counts_the_model_once_at_any_layout():
    one = run_script("pretrain_llama.py", FLAGS)
    assert _total(one.stdout) == tiny_llama_parameters(128)
    assert "run: 1 process = TP 1 x CP 1 x PP 1 x DP 1" in one.stdout
    assert "batch: 8 sequences x 16 tokens = 128 tokens per iteration" in one.stdout
    four = run_script("pretrain_llama.py", FLAGS + ["--tensor-model-parallel-size", "2",
                                                     "--pipeline-model-parallel-size", "2"],
                      nproc=4)
    assert _total(four.stdout) == tiny_llama_parameters(256)
    assert "run: 4 processes = TP 2 x CP 1 x PP 2 (1F1B) x DP 1" in four.stdout
    two = run_script("pretrain_llama.py", FLAGS + ["--use-distributed-optimizer",
                                                    "--job-name", "tiny-dp2"], nproc=2)
    assert _total(two.stdout) == tiny_llama_parameters(128)  # replicas counted once
    assert "job: tiny-dp2; run: 2 processes = TP 1 x CP 1 x PP 1 x DP 2" in two.stdout


def test_first_iteration_validation_and_closing_line(tmp_path):
    proc = run_script("pretrain_llama.py", FLAGS + ["--save", tmp_path / "ckpt"])
    train, valid = parse_losses(proc)
    logged = [int(n) for n in re.findall(r" iteration +(\d+)/ +6 \|", proc.stdout)]
    assert logged == [1, 4]  # the first iteration, then every --log-interval
    assert len(valid) == 1  # --eval-interval 100 never came: one validation after training
    closing = [line for line in proc.stdout.splitlines() if line.startswith("done: ")]
    assert len(closing) == 1, proc.stdout
    assert closing[0].startswith("done: 6 iterations (1-6), 768 tokens in ")
    assert f"validation at iteration 6: lm loss {valid[0]:.6E}" in closing[0]
    assert f"last checkpoint: iteration 6 in {tmp_path / 'ckpt'}" in closing[0]
    final = float(re.search(r"final lm loss ([0-9.E+-]+)", closing[0]).group(1))
    every = parse_losses(run_script("pretrain_llama.py", without(
        FLAGS, "--log-interval") + ["--log-interval", "1"]))[0]
    assert final == every[-1] and train[0] == every[0]
    # The second line averages iterations 2-4 (printed to 7 significant digits).
    assert abs(train[1] - sum(every[1:4]) / 3) <= 1e-6 * train[1]


def test_data_line_counts_samples_and_epochs_of_the_corpus(tmp_path):
    """30 documents of 40 tokens = 1,200 tokens an epoch; 6 iterations x 8 sequences of 16
    tokens need 768 of them for training (0.64 epochs)."""
    from tests.e2e.bad_inputs.test_data_inputs import NULL, TRAIN, write_dataset

    prefix = write_dataset(tmp_path / "data", 30)
    train = without(TRAIN, "--train-iters") + ["--train-iters", "6"]
    proc = run_script("pretrain_gpt.py", train + NULL + ["--data-path", prefix,
                                                         "--split", "100,0,0"])
    line = next(line for line in proc.stdout.splitlines() if line.startswith("data: "))
    assert line.startswith("data: train 48 samples of ") and \
        "(0.64 epochs of 1,200 tokens); valid none; test none" in line, line
