"""BlendedDataset: samples drawn from several datasets in proportion to their weights."""
from typing import Any, List, Sequence

import numpy as np
import torch

from megatron.core.datasets import helpers


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples interleaved from ``datasets`` so that every prefix of the blend holds
    each dataset's share (``weights``, normalised) to within one sample, in Megatron's greedy
    order. ``blend[i]`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``, unchanged.

    Each dataset must have at least as many samples as the blend takes from it; build them
    with over-provisioned sizes (``helpers.over_provisioned_sizes``).
    """

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], size: int):
        if len(datasets) == 0 or len(datasets) != len(weights):
            raise ValueError(f"need one weight per dataset, got {len(datasets)} datasets and "
                             f"{len(weights)} weights.")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"blend weights must be finite, >= 0 and not all 0; got {list(w)}.")
        if size < 1:
            raise ValueError(f"a blended dataset needs size >= 1, got {size}.")
        self.datasets: List[Any] = list(datasets)
        self.weights = (w / w.sum()).tolist()
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = helpers.build_blending_indices(
            self.weights, self.size)
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for k, dataset in enumerate(self.datasets):
            if needed[k] > len(dataset):
                raise ValueError(
                    f"blend: dataset {k} ({getattr(dataset, 'path_prefix', type(dataset).__name__)}"
                    f", weight {self.weights[k]:.4f}) has {len(dataset)} samples but the blend of "
                    f"{self.size} takes {needed[k]} from it; build it with at least that many "
                    f"(e.g. helpers.over_provisioned_sizes).")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples.")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
