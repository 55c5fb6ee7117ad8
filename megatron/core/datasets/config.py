"""GPTDatasetConfig, and parsing of Megatron's --data-path blends and --split strings."""
import math
import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")

# A blend: prefixes and their normalised weights.
Blend = Tuple[List[str], List[float]]


@dataclass
class GPTDatasetConfig:
    """Everything that decides which tokens a GPT sample holds and how a batch is masked.

    Data comes from one of: ``mock``; ``data_path`` (one blend, cut into train/valid/test
    by ``split``); or ``train_data_path``/``valid_data_path``/``test_data_path`` (one blend
    each, every document used). Paths take Megatron's forms: ``"prefix"``,
    ``"0.3 prefixA 0.7 prefixB"`` or the equivalent list ``["0.3", "prefixA", ...]``.
    """

    seq_length: int
    seed: int = 1234
    data_path: Optional[Union[str, Sequence[str]]] = None
    split: str = "969, 30, 1"
    train_data_path: Optional[Union[str, Sequence[str]]] = None
    valid_data_path: Optional[Union[str, Sequence[str]]] = None
    test_data_path: Optional[Union[str, Sequence[str]]] = None
    # Where index files are cached; None: "<prefix>/cache/GPTDataset_indices" beside the data.
    data_cache_path: Optional[str] = None
    mock: bool = False
    vocab_size: Optional[int] = None  # token ids of the mock data are drawn below this
    eod_token: int = 0
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # Extra data for the blend: each sub-dataset gets ceil(n * weight * (1 + surplus)) samples.
    blend_surplus: float = 0.005
    split_weights: List[float] = field(init=False, repr=False)

    def __post_init__(self):
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}.")
        sources = [self.mock, self.data_path is not None,
                   any(p is not None for p in (self.train_data_path, self.valid_data_path,
                                               self.test_data_path))]
        if sum(bool(s) for s in sources) != 1:
            raise ValueError("give exactly one data source: --mock-data, --data-path, or "
                             "--train-data-path/--valid-data-path/--test-data-path.")
        if self.mock and (self.vocab_size is None or self.vocab_size < 1):
            raise ValueError("mock data needs vocab_size >= 1 (the tokenizer's vocabulary).")
        self.split_weights = parse_split(self.split)

    def blend(self, split_name: Optional[str] = None) -> Optional[Blend]:
        """The (prefixes, weights) of --data-path, or of --<split_name>-data-path."""
        path = self.data_path if split_name is None else getattr(self, f"{split_name}_data_path")
        return None if path is None else parse_data_path(path)


def parse_data_path(spec: Union[str, Sequence[str]]) -> Blend:
    """``"0.3 a 0.7 b"`` -> (["a", "b"], [0.3, 0.7]); a lone ``"a"`` -> (["a"], [1.0]).

    Weights are normalised to sum to 1.
    """
    items = spec.split() if isinstance(spec, str) else [str(s) for s in spec]
    if len(items) == 1:
        return [items[0]], [1.0]
    if len(items) == 0 or len(items) % 2:
        raise ValueError(f"data path {spec!r}: give one prefix, or weight-prefix pairs like "
                         f"'0.3 prefixA 0.7 prefixB'.")
    prefixes, weights = [], []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"data path {spec!r}: {weight!r} is not a weight; give "
                             f"weight-prefix pairs like '0.3 prefixA 0.7 prefixB'.") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"data path {spec!r}: weight {weight} must be finite and >= 0.")
        prefixes.append(prefix)
        weights.append(value)
    total = np.sum(weights)
    if total <= 0:
        raise ValueError(f"data path {spec!r}: the weights sum to 0.")
    return prefixes, (np.asarray(weights) / total).tolist()  # as Megatron normalises


def parse_split(split: str) -> List[float]:
    """``"98,2,0"`` or ``"98/2/0"`` -> [0.98, 0.02, 0.0]; missing parts are 0, e.g. "1" -> train."""
    parts = [p for p in re.split(r"[,/]", split.replace(" ", "")) if p != ""]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split {split!r}: expected up to 3 numbers separated by ',' or '/', "
                         f"e.g. '969,30,1'.") from None
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"split {split!r}: expected 1 to 3 non-negative numbers separated by "
                         f"',' or '/', e.g. '969,30,1'.")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"split {split!r}: the parts sum to 0.")
    return [w / total for w in weights]


def get_split_indices(split_weights: Sequence[float], num_documents: int) -> List[int]:
    """Document boundaries [0, train_end, valid_end, test_end] (Megatron's _get_split_indices).

    Each part gets round(weight * n) documents; the rounding surplus or deficit shifts every
    boundary after 0, i.e. the train part absorbs it, as in Megatron.
    """
    indices = [0]
    for weight in split_weights:
        indices.append(indices[-1] + int(round(weight * float(num_documents))))
    excess = indices[-1] - num_documents
    indices[1:] = [i - excess for i in indices[1:]]
    assert indices[-1] == num_documents
    return indices
