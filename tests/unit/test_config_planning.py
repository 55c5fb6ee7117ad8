"""Every shipped config (shtools/configs/*.sh) as its defaults give it: parse_args +
build_configs accept it at the smallest world size it takes, and tools/plan_parallelism.py
parses and plans it (the layout flags it replaces go with the flags that need them); the
best plan's command builds too."""
import json
import os
import shlex
import sys

import pytest

from megatron.training.arguments import ConfigError, build_configs, parse_args
from megatron.training.checkpointing.checkpoint_args import use_checkpoint_args
from megatron.training.planner import workload_from_flags
from tests.unit.test_launch_templates import CONFIGS, ROOT, source_config


def stand_ins_for(args):
    """Empty files for the data prefixes and tokenizer paths parsed ``args`` name (relative
    paths: under the current directory)."""
    def touch(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        open(path, "w").close()

    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        for word in (getattr(args, name) or []) if not args.mock_data else []:
            try:
                float(word)  # a blend's weight
            except ValueError:
                touch(word + ".bin")
                touch(word + ".idx")
    if args.tokenizer_name_or_path:
        os.makedirs(args.tokenizer_name_or_path, exist_ok=True)
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, name, None):
            touch(getattr(args, name))


def smallest_world(flags):
    """The smallest world size whose build_configs (the entry point's, before the tokenizer)
    accepts ``flags``: TP x PP x CP times the first data-parallel size that works."""
    args = parse_args(flags, before_checks=use_checkpoint_args)
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * args.context_parallel_size)
    errors = []
    for dp in range(1, 1025):
        try:
            build_configs(parse_args(flags, before_checks=use_checkpoint_args),
                          model_parallel * dp)
            return model_parallel * dp
        except ConfigError as exc:
            errors.append(f"world {model_parallel * dp}: {exc}")
    pytest.fail("no world size takes the flags; " + " ... ".join(errors[:1] + errors[-1:]))


def _plan_parallelism():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import plan_parallelism
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    return plan_parallelism


def _config_in(tmp_path, monkeypatch, name):
    """(CONFIG_FLAGS, smallest world size) of a config as its defaults give it: its relative
    paths, as shipped, resolved in an empty directory holding stand-in files."""
    monkeypatch.chdir(tmp_path)
    entry, _, flags = source_config(CONFIGS[name])
    assert os.path.isfile(os.path.join(ROOT, entry)), entry
    stand_ins_for(parse_args(flags, before_checks=use_checkpoint_args))
    return flags, smallest_world(flags)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_parses_for_training_and_for_the_planner(name, tmp_path, monkeypatch):
    """The entry point's parse_args + build_configs accept each config at the smallest world
    size they take (smallest_world), and the planner parses it into a workload: the layout
    flags it replaces go, with the flags that need them (--reduce-bucket-size with
    --overlapped-distributed-optimizer), the rest parses."""
    flags, _ = _config_in(tmp_path, monkeypatch, name)
    workload = workload_from_flags(_plan_parallelism().flags_of_config_file(CONFIGS[name]),
                                   vocab_size=32000)
    assert workload.args.num_layers == parse_args(flags).num_layers


@pytest.mark.slow  # the planner's whole search: seconds for the MoE configs
@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_plans(name, tmp_path, monkeypatch, capsys):
    """tools/plan_parallelism.py plans each config on the smallest world it trains at, in the
    README's way (--config-file, --vocab-size, --num-gpus; the micro batch and global batch
    bounded to keep the search short), and its best row's command (and Megatron-LLaMA's
    spelling of its optimizer) parses and builds at that world size."""
    _, world = _config_in(tmp_path, monkeypatch, name)
    rc = _plan_parallelism().main([
        "--config-file", CONFIGS[name], "--vocab-size", "32000", "--num-gpus", str(world),
        "--gpus-per-node", str(min(8, world)), "--global-batch-size", str(world),
        "--max-micro-batch-size", "1", "--top", "1", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    best = json.loads(out)["rows"][0]
    commands = [shlex.split(best["command"])]
    overlapped = best["overlapped_distributed_optimizer"]
    if overlapped:
        commands.append([f for f in commands[0] if f not in (
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")]
            + shlex.split(overlapped["flags"]))
    for command in commands:
        build_configs(parse_args(command), world)
