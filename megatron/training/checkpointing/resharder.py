"""Building this rank's model and optimizer tensors from a checkpoint of another layout:
every saved (TP, PP) file is merged into full tensors (only those this rank needs), then cut
for this rank (see reshard.py for the arithmetic)."""
from typing import Callable, Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.tp_sharding import MTP_EMBEDDING_COPY
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.training.checkpointing.layout import model_key
from megatron.training.checkpointing.reshard import (
    join_optimizer_params,
    merge_tensor_parallel,
    renumber_layers,
    shard_for_rank,
    split_optimizer_params,
)


def full_from_files(files: Dict, saved_layout: Dict, pick,
                    wanted: Callable[[str], bool] = lambda name: True) -> Dict[str, torch.Tensor]:
    """Full tensors (global layer numbers, TP merged, vocab unpadded) from every saved (TP, PP)
    file. ``pick((tp, pp), saved_chunk)`` -> that chunk's tensors; ``wanted(name)`` filters."""
    full = {}
    for pp in range(saved_layout["pipeline_model_parallel_size"]):
        ranges = files[(0, pp)]["layout"]["layer_ranges"]
        for saved_chunk, (start, _) in enumerate(ranges):
            shards = [pick((tp, pp), saved_chunk)
                      for tp in range(saved_layout["tensor_model_parallel_size"])]
            merged = merge_tensor_parallel(shards, saved_layout["gated_mlp"],
                                           saved_layout["vocab_size"])
            for name, tensor in renumber_layers(merged, start).items():
                if wanted(name):
                    full[name] = tensor
    if saved_layout["tied_output"]:
        full.pop("output_layer.weight", None)  # the last stage's copy of the embedding
    full.pop(MTP_EMBEDDING_COPY, None)  # the same, untied, for multi-token prediction
    return full


class Resharder:
    """Builds this rank's tensors from every saved (TP, PP) file of another layout."""

    def __init__(self, files: Dict, saved_layout: Dict, layout: Dict, chunks, optim_files):
        self.files, self.saved, self.layout = files, saved_layout, layout
        self.chunks = [unwrap_model(c) for c in chunks]
        self.optim_files = optim_files

    def _wanted(self, name: str) -> bool:
        """Whether a full-model tensor can end up in one of this rank's chunks."""
        if name.startswith("decoder.layers."):
            index = int(name.split(".")[2])
            return any(s <= index < e for s, e in self.layout["layer_ranges"])
        if name.startswith("embedding."):
            # the first stage, or a later one with a copy of it (tied, or MTP's)
            return any(c.shared_embedding_or_output_weight() is not None
                       for c in self.chunks)
        return any(c.post_process for c in self.chunks)

    def _full(self, pick) -> Dict[str, torch.Tensor]:
        return full_from_files(self.files, self.saved, pick, self._wanted)

    def _for_chunk(self, full, chunk_index):
        chunk = self.chunks[chunk_index]
        return shard_for_rank(
            full, tuple(self.layout["layer_ranges"][chunk_index]), chunk.pre_process,
            chunk.post_process, self.layout["tied_output"], self.layout["gated_mlp"],
            self.layout["padded_vocab_size"], self.layout["tensor_model_parallel_size"],
            parallel_state.get_tensor_model_parallel_rank())

    def models(self) -> List[Dict[str, torch.Tensor]]:
        vpp = self.saved["virtual_pipeline_model_parallel_size"]
        full = self._full(lambda rank, c: self.files[rank][model_key(c, vpp)])
        return [self._for_chunk(full, c) for c in range(len(self.chunks))]

    def optimizer(self) -> Optional[Dict]:
        states = {rank: self.optim_files(rank) for rank in self.files}
        if any(s is None for s in states.values()):
            return None
        keys = sorted({k for s in states.values() for e in s["params"].values() for k in e})
        per_key = {}
        for key in keys:
            full = self._full(lambda rank, c: {
                n: t for n, t in split_optimizer_params(states[rank]["params"], c)
                .get(key, {}).items()})
            per_key[key] = [self._for_chunk(full, c) for c in range(len(self.chunks))]
        params = {}
        for c in range(len(self.chunks)):
            params.update(join_optimizer_params({k: v[c] for k, v in per_key.items()}, c))
        first = states[(0, 0)]
        return {**first, "params": params}
