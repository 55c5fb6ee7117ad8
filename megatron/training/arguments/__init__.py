"""Megatron's command-line flags -> config dataclasses. The ONE place that knows flag names.

    definitions.py  the argparse parser, group by group (``get_parser``), and ``NOOP_FLAGS``
    moe.py          the mixture-of-experts flags and their mapping onto MoEConfig
    data_parallel.py the data-parallel flags: the distributed optimizer, ZeRO-2, HSDP, FSDP2
    ranges.py       every numeric flag's valid range
    dependencies.py the flags that mean something only with another (``DEPENDENCIES``, one
                    table), refused when typed without it
    parse.py        ``parse_args`` / ``validate_args``: old spellings folded, checks that need
                    no world size
    configs.py      ``build_configs(args, world_size)``: the checks that need the world size or
                    the file system, and the configs

Users import from here: ``from megatron.training.arguments import parse_args, build_configs``.
Every problem raises ``ConfigError`` naming the flag and the fix.
"""
from megatron.training.arguments.configs import build_configs
from megatron.training.arguments.definitions import NOOP_FLAGS, get_parser
from megatron.training.arguments.parse import parse_args, validate_args
from megatron.training.training_config import ConfigError, MegatronConfigs, TrainingConfig

__all__ = ["ConfigError", "MegatronConfigs", "TrainingConfig", "build_configs", "get_parser",
           "parse_args", "validate_args", "NOOP_FLAGS"]
