"""Decoder-only language model (GPT; LLaMA is the same class with another config).

A model chunk holds layers ``layer_range`` and, with ``pre_process``, the embedding; with
``post_process``, the final norm and the output layer. It returns vocab-parallel logits
[b, s, vocab/TP], or the per-token loss [b, s] when labels are given, or (on a stage without
``post_process``) the hidden states [s, b, h] for the next pipeline stage.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.embedding import LanguageModelEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.param_sync import gathered
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_lookup,
)
from megatron.core.transformer.context_parallel import load_balanced_positions
from megatron.core.transformer.init_rng import (
    EMBEDDING_OFFSET,
    OUTPUT_LAYER_OFFSET,
    POSITION_EMBEDDING_OFFSET,
    draw_base_seed,
    init_rng,
)
from megatron.core.transformer.moe.moe_layer import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MultiTokenPrediction
from megatron.core.transformer.rope import RotaryEmbedding
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import hidden_dropout_rng
from megatron.core.utils import init_method_normal


class GPTModel(torch.nn.Module):
    def __init__(self, config: TransformerConfig, vocab_size: int,
                 padded_vocab_size: Optional[int] = None, pre_process: bool = True,
                 post_process: bool = True, share_embeddings_and_output_weights: bool = True,
                 layer_range: Optional[Tuple[int, int]] = None):
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size or vocab_size
        if self.padded_vocab_size < vocab_size:
            raise ValueError(f"padded vocab size {self.padded_vocab_size} < vocab size "
                             f"{vocab_size}.")
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.input_tensor = None
        base_seed = draw_base_seed()

        if pre_process:
            with init_rng(base_seed + EMBEDDING_OFFSET):
                self.embedding = LanguageModelEmbedding(
                    config, self.padded_vocab_size,
                    add_position_embedding=config.position_embedding_type == "learned_absolute",
                    position_seed=base_seed + POSITION_EMBEDDING_OFFSET)
        self.rotary = RotaryEmbedding(config) if config.position_embedding_type == "rope" \
            else None
        self.decoder = TransformerBlock(config, base_seed, layer_range, post_process)
        if post_process:
            tied_here = share_embeddings_and_output_weights and pre_process
            with init_rng(base_seed + (EMBEDDING_OFFSET if share_embeddings_and_output_weights
                                       else OUTPUT_LAYER_OFFSET)):
                # A tied output layer on a stage without the embedding gets the embedding's
                # initial weights (same seed); the pipeline keeps the two in sync.
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, self.padded_vocab_size, config=config, bias=False,
                    init_method=init_method_normal(config.init_method_std),
                    skip_weight_param_allocation=tied_here)
            if share_embeddings_and_output_weights and not pre_process:
                self.output_layer.weight.shared_embedding = True
                self.output_layer.weight.tied_across_stages = True
        # Multi-token prediction, with the output layer: it looks tokens up in the embedding
        # here, or on a later stage in a copy of it: the tied output layer, or (untied) its
        # own copy ``mtp.word_embeddings`` (Megatron's), kept equal like the tied one.
        self.mtp = None
        if post_process and config.mtp_num_layers:
            self.mtp = MultiTokenPrediction(config, base_seed)
            if not pre_process and share_embeddings_and_output_weights:
                # its lookups' gradient: the head's wgrad stays unfused
                self.output_layer.weight.has_other_uses = True
            elif not pre_process:
                with init_rng(base_seed + EMBEDDING_OFFSET):  # the embedding's initial weights
                    self.mtp.word_embeddings = VocabParallelEmbedding(
                        self.padded_vocab_size, config.hidden_size, config=config,
                        init_method=init_method_normal(config.init_method_std))
                self.mtp.word_embeddings.weight.shared_embedding = True
                self.mtp.word_embeddings.weight.tied_across_stages = True
        # Whether, at PP > 1, the last stage holds a copy of the embedding (tied_embeddings.py
        # keeps the two equal): the tied output layer, or multi-token prediction's table.
        self.embedding_tied_across_stages = share_embeddings_and_output_weights or \
            bool(config.mtp_num_layers)
        if pre_process and self.embedding_tied_across_stages and not post_process:
            # The other copy lives on the last stage (see tied_embeddings.py).
            self.embedding.word_embeddings.weight.tied_across_stages = True

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """Hidden states from the previous pipeline stage (used when not pre_process)."""
        self.input_tensor = input_tensor

    def _local_positions(self, hidden: torch.Tensor) -> torch.Tensor:
        """Global positions of this rank's tokens: 0..s-1, or under context parallelism its two
        chunks of the load-balanced layout."""
        seq_len = hidden.shape[0]
        if self.config.sequence_parallel:
            seq_len *= parallel_state.get_tensor_model_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
        if cp == 1:
            return torch.arange(seq_len, device=hidden.device)
        return load_balanced_positions(seq_len * cp, cp, parallel_state.get_context_parallel_rank(),
                                       device=hidden.device)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """This stage's copy of the word embedding, read outside its owner's forward (the
        tied head, multi-token prediction's lookups): current once returned (gathered())."""
        if self.pre_process:
            weight = self.embedding.word_embeddings.weight
        elif self.post_process and self.share_embeddings_and_output_weights:
            weight = self.output_layer.weight
        elif self.mtp is not None and self.mtp.word_embeddings is not None:
            weight = self.mtp.word_embeddings.weight
        else:
            return None
        return gathered(weight)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None,
                loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``packed_seq_params`` (documents packed in each sample, from
        ``packed_seq_params_from_eod``) replaces a per-document ``attention_mask``.
        ``loss_mask`` [b, s]: which labels count, for multi-token prediction's losses (all
        when None); the main per-token loss is returned unmasked as always."""
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
        else:
            hidden = self.input_tensor
        cos = sin = None
        if self.rotary is not None:
            if position_ids is None:  # a middle pipeline stage: this rank's positions
                position_ids = self._local_positions(hidden).unsqueeze(0)
            cos, sin = self.rotary(position_ids)
        mtp = self.mtp is not None and labels is not None
        hidden = self.decoder(hidden, attention_mask, cos, sin, packed_seq_params,
                              return_pre_norm=mtp)
        if not self.post_process:
            return hidden
        if mtp:
            hidden, pre_norm = hidden
            losses = self.mtp.losses(
                pre_norm, input_ids, labels,
                torch.ones_like(labels) if loss_mask is None else loss_mask,
                lambda ids: self._mtp_embed(ids, position_ids), self._per_token_loss, cos, sin,
                packed_seq_params)
            scale = self.config.mtp_loss_scaling_factor / len(losses)
            hidden = MoEAuxLossAutoScaler.apply(hidden, scale * sum(losses))
        if labels is None:
            return self._logits(hidden).transpose(0, 1).contiguous()
        return self._per_token_loss(hidden, labels)

    def _output_weight(self):
        """The tied head's weight: the embedding's, another module's parameter."""
        if self.share_embeddings_and_output_weights and self.pre_process:
            return gathered(self.embedding.word_embeddings.weight)
        return None

    def _logits(self, hidden):
        """[s, b, h] -> [s, b, vocab/TP]."""
        logits, _ = self.output_layer(hidden, weight=self._output_weight())
        return logits

    def _per_token_loss(self, hidden, labels):
        """[s, b, h], labels [b, s] -> the per-token loss [b, s]."""
        loss = vocab_parallel_cross_entropy(
            self._logits(hidden), labels.transpose(0, 1),
            vocab_size=self.vocab_size if self.padded_vocab_size != self.vocab_size else None,
            inplace=True,  # the logits are ours and read by nothing else
            fused=self.config.torch_compile)  # no fp32 copy of the logits
        return loss.transpose(0, 1).contiguous()

    def _mtp_embed(self, input_ids, position_ids=None):
        """[b, s] -> [s, b, h] (sequence-sharded under SP) from the embedding (with the
        positions of this rank's tokens), or on a later stage from its copy there (the tied
        output layer, or ``mtp.word_embeddings``)."""
        if self.pre_process:
            return self.embedding(input_ids, position_ids)
        hidden = vocab_parallel_lookup(input_ids, self.shared_embedding_or_output_weight(),
                                       reduce_scatter=self.config.sequence_parallel)
        if not self.config.sequence_parallel:
            hidden = hidden.transpose(0, 1).contiguous()
        with hidden_dropout_rng(self.config):  # the embedding's dropout, as at PP 1
            return F.dropout(hidden, self.config.hidden_dropout, self.training)
