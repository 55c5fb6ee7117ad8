"""Token (+ learned absolute position) embedding, producing [s, b, h] for the transformer."""
from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import device, parallel_state
from megatron.core.tensor_parallel import (
    VocabParallelEmbedding,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.init_rng import init_rng
from megatron.core.transformer.transformer_layer import hidden_dropout_rng
from megatron.core.utils import init_method_normal


class LanguageModelEmbedding(torch.nn.Module):
    def __init__(self, config, vocab_size: int, add_position_embedding: bool,
                 position_seed: Optional[int] = None):
        super().__init__()
        self.config = config
        init = init_method_normal(config.init_method_std)
        # Without positions to add, the TP reduction can directly scatter the sequence.
        self.reduce_scatter = config.sequence_parallel and not add_position_embedding and \
            parallel_state.get_tensor_model_parallel_world_size() > 1
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, config.hidden_size, config=config, init_method=init,
            reduce_scatter_embeddings=self.reduce_scatter)
        self.position_embeddings = None
        if add_position_embedding:
            # Its own seed: drawn after the word embeddings it would depend on the padded
            # vocabulary, hence on the TP size.
            master = torch.empty(config.max_position_embeddings, config.hidden_size)
            with init_rng(position_seed) if position_seed is not None else nullcontext():
                init(master)
            self.position_embeddings = torch.nn.Embedding(
                config.max_position_embeddings, config.hidden_size,
                dtype=config.params_dtype, device=device.current_device())
            with torch.no_grad():
                self.position_embeddings.weight.copy_(master)

    def forward(self, input_ids, position_ids=None):
        """input_ids [b, s] -> [s, b, h] (this rank's sequence shard under SP)."""
        hidden = self.word_embeddings(input_ids)
        if not self.reduce_scatter:
            if self.position_embeddings is not None:
                if position_ids is None:
                    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
                hidden = hidden + self.position_embeddings(position_ids)
            hidden = hidden.transpose(0, 1).contiguous()
            if self.config.sequence_parallel:
                hidden = scatter_to_sequence_parallel_region(hidden)
        with hidden_dropout_rng(self.config):
            return F.dropout(hidden, self.config.hidden_dropout, self.training)
