"""The training loop's side of the data: Megatron's pretraining samplers and the DataLoader
built on them (samplers.py), and a loader batch turned into model inputs (batch.py). The
datasets themselves are megatron.core.datasets."""
