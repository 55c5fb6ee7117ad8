"""The script framework (flags, training loop, checkpointing); see the training issue."""
