"""Top-k router: fp32 logits, scores, top-k selection, load-balancing losses.

Tokens arrive flattened from [s, b, h], so token t belongs to sequence t % b (the per-sequence
aux loss relies on that order). The losses are returned already multiplied by their
coefficients, for the caller to add to the model's loss.

Under sequence parallelism each TP rank routes its own part of the sequence, and under context
parallelism each CP rank its chunks (``group``: TP, CP, or TP x CP): the token counts are summed
over it first, and each rank returns its share of the loss (its tokens' scores over the whole
micro batch's token count), so the shares add up over the group to the loss of the whole micro
batch, whatever the TP and CP sizes.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.transformer.moe.capacity import count_per_expert


def route(logits, topk, score_function="softmax", pre_softmax=False, topk_norm=False,
          expert_bias=None, num_groups=None, group_topk=None, scaling_factor=None):
    """logits [T, E] fp32 -> (probs [T, k], indices [T, k]).

    softmax, pre_softmax=False (Megatron's default): top-k of the logits, softmax over those k.
    softmax, pre_softmax=True: softmax over all E, then top-k (optionally renormalised).
    sigmoid: sigmoid scores, top-k (optionally renormalised).
    expert_bias [E] is added to what the top-k ranks, never to the returned gate weights.
    num_groups/group_topk: group-limited routing (DeepSeek-V3), see ``keep_best_groups``.
    scaling_factor multiplies the gate weights last (DeepSeek-V3's routed scaling factor).
    """
    if score_function == "softmax" and not pre_softmax:
        top_logits, indices = _topk(logits, topk, expert_bias, num_groups, group_topk)
        probs = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.softmax(logits, dim=-1) if score_function == "softmax" \
            else logits.sigmoid()
        probs, indices = _topk(scores, topk, expert_bias, num_groups, group_topk)
        if topk_norm:
            total = probs.sum(dim=-1, keepdim=True)
            if score_function == "sigmoid":  # as HF's DeepseekV3; a no-op above ~1e-13
                total = total + 1e-20
            probs = probs / total
    if scaling_factor is not None:
        probs = probs * scaling_factor
    return probs, indices


def _topk(values, k, bias, num_groups=None, group_topk=None):
    if bias is None and num_groups is None:
        return torch.topk(values, k, dim=-1)
    ranked = values if bias is None else values + bias
    if num_groups is not None:
        ranked = keep_best_groups(ranked, num_groups, group_topk)
    _, indices = torch.topk(ranked, k, dim=-1)
    return values.gather(-1, indices), indices


def keep_best_groups(ranked, num_groups, group_topk):
    """ranked [T, E] with -inf outside each token's ``group_topk`` best groups of experts.

    The experts are cut into ``num_groups`` groups of consecutive experts (global numbers:
    routing happens before dispatch, so under EP too); a group's score is the sum of its two
    highest values, so one outlier expert does not carry a group."""
    tokens, experts = ranked.shape
    grouped = ranked.reshape(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    best = group_scores.topk(group_topk, dim=-1).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).reshape(tokens, experts)


def aux_loss_scores(logits, score_function):
    """Per-token distribution over all experts that the aux loss balances (P): the softmax,
    or the sigmoid scores normalised to sum to 1 (as Megatron does)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = logits.sigmoid()
    return scores / scores.sum(dim=-1, keepdim=True)


def _summed_over(counts, group):
    """counts summed over the ranks of ``group`` (no gradient: counts have none), and the
    number of ranks."""
    if group is None:
        return counts, 1
    counts = counts.clone()
    dist.all_reduce(counts, group=group)
    return counts, dist.get_world_size(group)


def switch_aux_loss(scores, indices, num_experts, group=None):
    """Switch/GShard load balancing: E * sum_e f_e * P_e, where f_e is the fraction of the
    T*k routing choices that picked expert e and P_e the mean score of expert e."""
    counts = count_per_expert(indices, num_experts).to(scores.dtype)
    counts, ranks = _summed_over(counts, group)
    tokens = scores.shape[0] * ranks
    fraction = counts / (tokens * indices.shape[-1])
    mean_score = scores.sum(dim=0) / tokens
    return num_experts * torch.sum(fraction * mean_score)


def seq_aux_loss(scores, indices, num_experts, num_sequences, group=None):
    """The Switch loss per sequence (tokens ordered [s, b]), averaged over the b sequences."""
    seq_len = scores.shape[0] // num_sequences
    seq_scores = scores.reshape(seq_len, num_sequences, num_experts)
    seq_indices = indices.reshape(seq_len, num_sequences, -1)
    one_hot = F.one_hot(seq_indices, num_experts).sum(dim=2).to(scores.dtype)  # [s, b, E]
    counts, ranks = _summed_over(one_hot.sum(dim=0), group)  # [b, E]
    full_len = seq_len * ranks
    fraction = counts / (full_len * indices.shape[-1])
    mean_score = seq_scores.sum(dim=0) / full_len  # [b, E]
    return num_experts * torch.sum(fraction * mean_score, dim=-1).mean()


def z_loss(logits, group=None):
    """Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2."""
    ranks = 1 if group is None else dist.get_world_size(group)
    return torch.logsumexp(logits, dim=-1).square().sum() / (logits.shape[0] * ranks)


@torch.no_grad()
def update_expert_bias(bias, tokens_per_expert, rate):
    """Aux-loss-free balancing step, in place: raise the bias of under-loaded experts and
    lower that of over-loaded ones by `rate` (the sign of mean load minus own load)."""
    load = tokens_per_expert.to(bias.dtype)
    bias.add_(torch.sign(load.mean() - load) * rate)
    return bias


class TopKRouter(torch.nn.Module):
    def __init__(self, config, hidden_size, init_method_std=0.02, sequence_group=None):
        super().__init__()
        self.config = config
        self.sequence_group = sequence_group  # TP under SP, CP, or both (see the module doc)
        self.weight = torch.nn.Parameter(torch.empty(config.num_moe_experts, hidden_size))
        torch.nn.init.normal_(self.weight, std=init_method_std)
        # gpt-oss's learned logit bias (zeros: no draw from the RNG, so the weights above and
        # everything initialised after are those of a model without it)
        self.bias = torch.nn.Parameter(torch.zeros(config.num_moe_experts)) \
            if config.moe_router_bias else None
        if config.moe_router_enable_expert_bias:
            # Buffers, not parameters: the optimizer never sees them.
            experts = config.num_moe_experts
            self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(experts, dtype=torch.float32), persistent=False)
        else:
            self.expert_bias = None

    def forward(self, hidden, num_sequences=1):
        """hidden [T, h] -> (probs [T, k] fp32, indices [T, k], losses dict)."""
        cfg = self.config
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(hidden.float(), self.weight.float(), bias)  # fp32 router
        probs, indices = route(logits, cfg.moe_router_topk, cfg.moe_router_score_function,
                               cfg.moe_router_pre_softmax, cfg.moe_router_topk_norm,
                               self.expert_bias, cfg.moe_router_num_groups,
                               cfg.moe_router_group_topk, cfg.moe_router_topk_scaling_factor)
        # Recomputation runs a forward twice: count the one with grad enabled.
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            self.local_tokens_per_expert += count_per_expert(indices, cfg.num_moe_experts)
        return probs, indices, self._losses(logits, indices, num_sequences)

    def _losses(self, logits, indices, num_sequences):
        cfg, losses, group = self.config, {}, self.sequence_group
        balancing = cfg.moe_router_load_balancing_type
        if balancing != "none" and cfg.moe_aux_loss_coeff > 0:
            scores = aux_loss_scores(logits, cfg.moe_router_score_function)
            if balancing == "aux_loss":
                loss = switch_aux_loss(scores, indices, cfg.num_moe_experts, group)
            else:
                loss = seq_aux_loss(scores, indices, cfg.num_moe_experts, num_sequences, group)
            losses["aux_loss"] = cfg.moe_aux_loss_coeff * loss
        if cfg.moe_z_loss_coeff:
            losses["z_loss"] = cfg.moe_z_loss_coeff * z_loss(logits, group)
        return losses

    def update_expert_bias(self):
        """Apply the aux-loss-free update from the counts since the last call, then reset
        them (called once per optimizer step; under DP the counts are summed first)."""
        update_expert_bias(self.expert_bias, self.local_tokens_per_expert,
                           self.config.moe_router_bias_update_rate)
        self.local_tokens_per_expert.zero_()
