"""Before a conversion writes anything: every tensor has the shape the config (config.json, or
the args a checkpoint records) implies, read off transformers' meta-device model of it."""
import os

import hf_io
import megatron_args
from conversion_utils import ConversionError, check_shapes
from megatron.core.models.hf_conversion import hf_to_megatron

EMBEDDING = "embedding.word_embeddings.weight"


def check_hf(hf_state, config, hf_dir: str) -> None:
    """Every HF tensor has the shape config.json gives it: the weights are the truth, and a
    size config.json gets wrong would otherwise be written into the flags and args."""
    config_path = os.path.join(hf_dir, "config.json")
    check_shapes(hf_state, hf_io.expected_tensors(config, config_path),
                 f"the weights in {hf_dir} do not fit {config_path}", "config.json",
                 "correct config.json to describe the weights, or re-download the model if a "
                 "weight file is damaged.")


def check_megatron(full, hf_config, iteration_dir: str) -> None:
    """Every tensor of our checkpoint has the shape its saved args give it: transformers'
    model of the args' HF equivalent, its tensors mapped to ours by the converter."""
    expected = hf_to_megatron(hf_io.expected_tensors(hf_config, f"{iteration_dir}'s args"),
                              hf_config)
    check_shapes(full, expected, f"the checkpoint {iteration_dir} does not fit the args it "
                 f"records", "its args", "the checkpoint is damaged or was not written with "
                 "these args: convert another iteration (--ckpt-step) or re-save it.")


def check_resharded(full, layout, args, iteration_dir: str) -> None:
    """check_megatron for a checkpoint whose model has a Hugging Face equivalent (the
    shapes come through it); one without (no HF config for its args) is copied unchecked."""
    try:
        hf_config = megatron_args.hf_config_from_args(args, layout["vocab_size"],
                                                      full[EMBEDDING].dtype, {})
    except ConversionError:
        return
    check_megatron(full, hf_config, iteration_dir)
