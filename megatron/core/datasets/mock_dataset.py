"""MockGPTDataset (--mock-data): deterministic random tokens, no files."""
from typing import Dict

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length + 1`` token ids in [0, vocab_size).

    Sample i depends only on (seed, i), so it is the same on every rank, in every DataLoader
    worker and after a restart, whatever order samples are read in. Each split gets its own
    stream (``split_name`` is mixed into the seed).
    """

    _SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234,
                 split_name: str = "train"):
        if num_samples < 1 or seq_length < 1 or vocab_size < 1:
            raise ValueError(f"mock data needs num_samples, seq_length and vocab_size >= 1; got "
                             f"{num_samples}, {seq_length}, {vocab_size}.")
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self.split_name = split_name
        self._split_id = self._SPLIT_IDS.get(split_name, len(self._SPLIT_IDS))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not -self.num_samples <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} mock samples.")
        rng = np.random.default_rng([self.seed, self._split_id, int(idx) % self.num_samples])
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}
