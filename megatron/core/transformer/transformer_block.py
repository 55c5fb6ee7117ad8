"""A stack of transformer layers (one pipeline stage's share), with the final norm on the last
stage and Megatron's full activation recomputation."""
from typing import Optional, Tuple

import torch

from megatron.core.tensor_parallel import checkpoint
from megatron.core.transformer.init_rng import FIRST_LAYER_OFFSET, init_rng
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_layer import TransformerLayer


class TransformerBlock(torch.nn.Module):
    """Layers ``layer_range = (start, end)`` (0-based, end exclusive) of the full model."""

    def __init__(self, config, base_seed: int, layer_range: Optional[Tuple[int, int]] = None,
                 post_process: bool = True):
        super().__init__()
        start, end = layer_range or (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer range {start}..{end} is not within the model's "
                             f"{config.num_layers} layers.")
        self.config = config
        self.layer_offset = start
        layers = []
        for number in range(start + 1, end + 1):
            with init_rng(base_seed + FIRST_LAYER_OFFSET + number):
                layers.append(TransformerLayer(config, number))
        self.layers = torch.nn.ModuleList(layers)
        self.final_layernorm = build_norm(config) if post_process else None

    def _run(self, start, end):
        def run(hidden, attention_mask, rotary_cos, rotary_sin, packed_seq_params):
            for layer in self.layers[start:end]:
                hidden = layer(hidden, attention_mask, rotary_cos, rotary_sin, packed_seq_params)
            return hidden
        return run

    def _recompute_spans(self):
        """(start, end, recompute?) spans of local layers, per Megatron's recompute_method:
        'uniform' checkpoints groups of recompute_num_layers layers; 'block' checkpoints the
        first recompute_num_layers layers one by one and runs the rest normally."""
        n, k = len(self.layers), self.config.recompute_num_layers
        if self.config.recompute_granularity != "full":
            return [(0, n, False)]
        if self.config.recompute_method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        return [(i, i + 1, i < k) for i in range(n)]

    def forward(self, hidden, attention_mask=None, rotary_cos=None, rotary_sin=None,
                packed_seq_params=None, return_pre_norm: bool = False):
        """-> the hidden states (after the final norm on the last stage); with
        ``return_pre_norm`` (multi-token prediction's input) also those before it."""
        args = (hidden, attention_mask, rotary_cos, rotary_sin, packed_seq_params)
        for start, end, recompute in self._recompute_spans():
            if recompute:
                hidden = checkpoint(self._run(start, end),
                                    self.config.distribute_saved_activations, *args)
            else:
                hidden = self._run(start, end)(*args)
            args = (hidden,) + args[1:]
        pre_norm = hidden
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return (hidden, pre_norm) if return_pre_norm else hidden
