"""Checkpoints in Megatron's layout: atomic saves (optionally in the background), safe loads,
exact resume, and loading into another parallel layout."""
from megatron.training.checkpointing.load import LoadedCheckpoint, load_checkpoint
from megatron.training.checkpointing.paths import CheckpointError
from megatron.training.checkpointing.save import save_checkpoint
from megatron.training.checkpointing.writer import CheckpointWriter

__all__ = ["CheckpointError", "CheckpointWriter", "LoadedCheckpoint", "load_checkpoint",
           "save_checkpoint"]
