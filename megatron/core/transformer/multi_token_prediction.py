"""Multi-token prediction (DeepSeek-V3, Megatron's --mtp-num-layers D): after the main model,
D sequential modules each predict one token further ahead.

Depth k (1..D) takes the previous depth's hidden states h (the main model's, before its final
norm, for k = 1) and the embeddings of the tokens k positions ahead, and computes
    h_k = Layer_k(W_k [hnorm_k(h_{k-1}); enorm_k(emb(t_{i+k}))])
then logits from the shared output head on final_norm_k(h_k), predicting t_{i+k+1}: the main
model's labels shifted k positions (the last k positions have no label and are masked). Each
depth's loss is the masked mean of its per-token loss; their sum times
``mtp_loss_scaling_factor / D`` joins the main loss's gradient through the auxiliary-loss
scaler the MoE losses use (scaled per microbatch like the main loss), and each depth's value
is recorded for the log.

The embedding and output head are the model's own (shared, as DeepSeek-V3 shares them): the
modules sit with the output layer on the last pipeline stage, which looks tokens up in the
embedding there (PP = 1) or in its copy of it: the output layer of a model with tied
embeddings, else ``word_embeddings`` here (Megatron's), kept equal to the embedding like the
tied output layer (GPTModel, tied_embeddings.py). Under tensor parallelism W_k is replicated;
with sequence parallelism its gradient covers this rank's tokens and is summed over TP like
the norms'. Under context parallelism the shift is along the whole sequence (the token ids,
labels and loss mask gathered over CP) and each depth's mean is over the whole sequence's.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import device, parallel_state
from megatron.core.transformer.context_parallel import shard_sequence, unshard_sequence
from megatron.core.transformer.init_rng import init_rng
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_layer import TransformerLayer

MTP_OFFSET = 50_000  # init seeds of the MTP depths: base + MTP_OFFSET + depth


def shifted(tensor: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """[b, s] -> the same k positions further along the sequence, the last k filled."""
    out = torch.roll(tensor, -k, dims=1)
    out[:, -k:] = fill
    return out


class _Shifter:
    """``shifted`` along the whole sequence: under context parallelism this rank's [b, s/CP]
    tensors are gathered once over CP, shifted whole, and this rank's positions taken back."""

    def __init__(self, *tensors):
        cp = parallel_state.get_context_parallel_world_size()
        self.cp = cp
        if cp > 1:
            group = parallel_state.get_context_parallel_group()
            gathered = []
            for tensor in tensors:
                parts = [torch.empty_like(tensor) for _ in range(cp)]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                gathered.append(unshard_sequence(parts, dim=1))
            tensors = gathered
        self.tensors = tensors

    def __call__(self, index: int, k: int, fill=0) -> torch.Tensor:
        out = shifted(self.tensors[index], k, fill)
        if self.cp == 1:
            return out
        return shard_sequence(out, 1, self.cp, parallel_state.get_context_parallel_rank())


class MultiTokenPredictionDepth(torch.nn.Module):
    """One depth: the norms, the projection of [hidden; embedding], a transformer layer (the
    same kind as the model's last: MoE where that one is) and the norm before the head."""

    def __init__(self, config, depth: int, base_seed: int):
        super().__init__()
        h = config.hidden_size
        with init_rng(base_seed + MTP_OFFSET + depth):
            self.enorm = build_norm(config)
            self.hnorm = build_norm(config)
            master = torch.empty(h, 2 * h)
            torch.nn.init.normal_(master, std=config.init_method_std)
            self.eh_proj = torch.nn.Parameter(master.to(device=device.current_device(),
                                                        dtype=config.params_dtype))
            if config.sequence_parallel:  # each TP rank's tokens: summed over TP
                self.eh_proj.sequence_parallel = True
            self.layer = TransformerLayer(config, config.num_layers + depth,
                                          moe=_last_layer_is_moe(config))
            self.final_layernorm = build_norm(config)

    def forward(self, hidden, embedded, rotary_cos, rotary_sin, packed_seq_params):
        """hidden, embedded [s, b, h] (sequence-sharded under SP) -> h_k [s, b, h] (before
        the head's norm)."""
        joined = torch.cat([self.hnorm(hidden), self.enorm(embedded)], dim=-1)
        return self.layer(F.linear(joined, self.eh_proj), None, rotary_cos, rotary_sin,
                          packed_seq_params)


def _last_layer_is_moe(config) -> bool:
    return config.moe is not None and config.moe.is_moe_layer(config.num_layers)


class MultiTokenPrediction(torch.nn.Module):
    """The D depths, and the loss record the training log reads (``take_metrics``)."""

    def __init__(self, config, base_seed: int):
        super().__init__()
        self.config = config
        self.depths = torch.nn.ModuleList(
            MultiTokenPredictionDepth(config, k, base_seed)
            for k in range(1, config.mtp_num_layers + 1))
        # A copy of the embedding on a later stage than it, untied (set by GPTModel).
        self.word_embeddings = None
        self._loss_sums = None
        self._forwards = 0

    def losses(self, hidden, input_ids, labels, loss_mask, embed, head, rotary_cos, rotary_sin,
               packed_seq_params):
        """Each depth's masked mean loss (0-dim fp32 tensors, differentiable); under context
        parallelism this rank's share of it (its tokens' sum over the global count: the CP
        ranks' shares add up to it). ``embed(ids)`` gives [s, b, h] embeddings,
        ``head(hidden)`` the per-token loss [b, s] of labels."""
        shift = _Shifter(input_ids, labels, loss_mask.float())
        totals, counts = [], []
        for k, depth in enumerate(self.depths, start=1):
            hidden = depth(hidden, embed(shift(0, k)), rotary_cos, rotary_sin,
                           packed_seq_params)
            per_token = head(depth.final_layernorm(hidden), shift(1, k))
            mask = shift(2, k)
            totals.append((per_token.float() * mask).sum())
            counts.append(mask.sum())
        counts = torch.stack(counts)
        values = torch.stack([t.detach() for t in totals])
        if shift.cp > 1:  # one all-reduce of [D sums, D counts]
            both = torch.cat([values, counts])
            dist.all_reduce(both, group=parallel_state.get_context_parallel_group())
            values, counts = both.chunk(2)
        counts = counts.clamp(min=1.0)
        if self.training and torch.is_grad_enabled():
            self._record(values / counts)
        return [total / count for total, count in zip(totals, counts)]

    @torch.no_grad()
    def _record(self, values):
        self._loss_sums = values if self._loss_sums is None else self._loss_sums + values
        self._forwards += 1

    def take_metrics(self):
        """(per-depth loss sums [D], forwards) since the last call, reset."""
        sums, forwards = self._loss_sums, self._forwards
        self._loss_sums, self._forwards = None, 0
        return sums, forwards
