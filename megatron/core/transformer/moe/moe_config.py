"""MoEConfig: the mixture-of-experts settings, with Megatron-Core's field names.

Kept apart from TransformerConfig until the MoE layer is wired into the model; every bad
combination is a ValueError that names the field and says how to fix it.
"""
from dataclasses import dataclass
from typing import List, Optional, Union

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
TOKEN_DISPATCHERS = ("alltoall", "allgather")


@dataclass
class MoEConfig:
    num_moe_experts: int
    """Number of routed experts (E)."""

    moe_ffn_hidden_size: int
    """Intermediate size of each routed expert's SwiGLU FFN."""

    moe_router_topk: int = 2
    """Experts each token is sent to (k)."""

    moe_router_score_function: str = "softmax"
    """"softmax" or "sigmoid" scores from the router logits."""

    moe_router_pre_softmax: bool = False
    """Megatron's meaning: softmax over all E experts BEFORE the top-k (gates then sum to < 1,
    Qwen-MoE style). Default (False): top-k on the logits, then softmax over the k chosen
    logits (gates sum to 1, Mixtral style). Softmax score function only."""

    moe_router_topk_norm: bool = False
    """Renormalise the k chosen probabilities to sum to 1 (HF's norm_topk_prob; Mixtral and
    Qwen3-MoE do it). A no-op for softmax without pre-softmax, where they already sum to 1."""

    moe_router_load_balancing_type: str = "aux_loss"
    """"aux_loss" (Switch/GShard over the micro batch), "seq_aux_loss" (per sequence) or
    "none"."""

    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss; 0 turns it off."""

    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss (mean logsumexp(logits)^2); None turns it off."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the
    top-k SELECTION only, updated from the token counts by update_expert_bias."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update."""

    moe_router_num_groups: Optional[int] = None
    """Group-limited routing (DeepSeek-V3's n_group): the experts are cut into this many
    groups of consecutive experts and each token chooses only among its
    moe_router_group_topk best groups, a group scored by the sum of its two highest
    (expert-biased) scores. None: no groups."""

    moe_router_group_topk: Optional[int] = None
    """Groups each token may route to (DeepSeek-V3's topk_group); set with
    moe_router_num_groups."""

    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplies the gate weights after any renormalisation (DeepSeek-V3's
    routed_scaling_factor); None: no scaling."""

    moe_router_bias: bool = False
    """A learned bias [E] on the router's logits (gpt-oss), trained like its weight; it enters
    the scores and the gate weights. Unrelated to moe_router_enable_expert_bias."""

    moe_expert_capacity_factor: Optional[float] = None
    """Keep at most ceil(T*k/E * factor) tokens per expert; None keeps every token."""

    moe_token_drop_policy: str = "probs"
    """Which tokens an over-full expert keeps: the highest "probs", or the first by
    "position"."""

    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to exactly its capacity (static shapes)."""

    moe_shared_expert_intermediate_size: Optional[int] = None
    """Intermediate size of the shared expert every token goes through; None = none."""

    moe_shared_expert_gate: bool = False
    """Qwen2-MoE's sigmoid gate on the shared expert's output."""

    moe_grouped_gemm: bool = False
    """Run the experts as grouped GEMMs (torch._grouped_mm where it applies)."""

    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE (Megatron's meaning): N makes 0-based layer i MoE iff i % N == 0;
    a list gives 1 (MoE) or 0 (dense) per layer."""

    moe_token_dispatcher_type: str = "alltoall"
    """How tokens reach the expert-parallel ranks: "alltoall", or "allgather" (the simple
    reference: every rank sees every token)."""

    def __post_init__(self):
        self._check_sizes()
        self._check_layer_freq()
        self._check_router()
        self._check_groups()
        self._check_capacity()
        self._check_shared_expert()

    def _check_sizes(self):
        if not isinstance(self.num_moe_experts, int) or self.num_moe_experts < 1:
            _fail("num_moe_experts", self.num_moe_experts, "set it to a positive integer")
        if not isinstance(self.moe_ffn_hidden_size, int) or self.moe_ffn_hidden_size < 1:
            _fail("moe_ffn_hidden_size", self.moe_ffn_hidden_size,
                  "set it to a positive integer")
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            _fail("moe_router_topk", self.moe_router_topk,
                  f"use 1..num_moe_experts ({self.num_moe_experts})")

    def _check_layer_freq(self):
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                _fail("moe_layer_freq", freq, "use N >= 1 (every N-th layer) or a 0/1 list")
        elif not freq or any(v not in (0, 1) for v in freq):
            _fail("moe_layer_freq", freq, "a list must hold one 0 or 1 per layer")
        if self.moe_token_dispatcher_type not in TOKEN_DISPATCHERS:
            _fail("moe_token_dispatcher_type", self.moe_token_dispatcher_type,
                  f"use one of {TOKEN_DISPATCHERS}")

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether the layer with this 1-based global number has experts."""
        if isinstance(self.moe_layer_freq, int):
            return (layer_number - 1) % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer_number - 1])

    def _check_router(self):
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            _fail("moe_router_score_function", self.moe_router_score_function,
                  f"use one of {SCORE_FUNCTIONS}")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            _fail("moe_router_pre_softmax", True,
                  "it applies to the softmax score function only; drop it for sigmoid")
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            _fail("moe_router_load_balancing_type", self.moe_router_load_balancing_type,
                  f"use one of {LOAD_BALANCING_TYPES}")
        if self.moe_aux_loss_coeff < 0:
            _fail("moe_aux_loss_coeff", self.moe_aux_loss_coeff, "use a value >= 0")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            _fail("moe_z_loss_coeff", self.moe_z_loss_coeff, "use a value >= 0 or None")
        if self.moe_router_bias_update_rate <= 0:
            _fail("moe_router_bias_update_rate", self.moe_router_bias_update_rate,
                  "use a value > 0")

    def _check_groups(self):
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and not factor > 0:
            _fail("moe_router_topk_scaling_factor", factor, "use a value > 0, or None for 1")
        if (groups is None) != (group_topk is None):
            name, value = ("moe_router_num_groups", groups) if group_topk is None \
                else ("moe_router_group_topk", group_topk)
            _fail(name, value, "moe_router_num_groups and moe_router_group_topk come as a "
                  "pair: set both, or neither for routing without groups")
        if groups is None:
            return
        experts = self.num_moe_experts
        if not isinstance(groups, int) or groups < 1 or experts % groups:
            _fail("moe_router_num_groups", groups,
                  f"use a divisor of num_moe_experts ({experts}): the groups are equal")
        if experts // groups < 2:
            _fail("moe_router_num_groups", groups,
                  f"each group needs at least 2 experts (a group is scored by its top 2); "
                  f"use at most {experts // 2} groups for {experts} experts")
        if not isinstance(group_topk, int) or not 1 <= group_topk <= groups:
            _fail("moe_router_group_topk", group_topk,
                  f"use 1..moe_router_num_groups ({groups})")
        reachable = group_topk * (experts // groups)
        if self.moe_router_topk > reachable:
            _fail("moe_router_topk", self.moe_router_topk,
                  f"the {group_topk} chosen groups hold only {reachable} experts; raise "
                  f"moe_router_group_topk or lower the top-k to at most {reachable}")

    def _check_capacity(self):
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor <= 0:
            _fail("moe_expert_capacity_factor", factor, "use a value > 0, or None for no dropping")
        if self.moe_token_drop_policy not in TOKEN_DROP_POLICIES:
            _fail("moe_token_drop_policy", self.moe_token_drop_policy,
                  f"use one of {TOKEN_DROP_POLICIES}")
        if self.moe_pad_expert_input_to_capacity and factor is None:
            _fail("moe_pad_expert_input_to_capacity", True,
                  "padding needs a capacity: set moe_expert_capacity_factor too")

    def _check_shared_expert(self):
        size = self.moe_shared_expert_intermediate_size
        if size is not None and (not isinstance(size, int) or size < 1):
            _fail("moe_shared_expert_intermediate_size", size,
                  "set it to a positive integer, or None for no shared expert")
        if self.moe_shared_expert_gate and size is None:
            _fail("moe_shared_expert_gate", True,
                  "the gate needs a shared expert: set moe_shared_expert_intermediate_size")


def _fail(field, value, fix):
    raise ValueError(f"MoEConfig.{field}={value!r} is invalid: {fix}")
