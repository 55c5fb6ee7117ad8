"""Delayed scaling (``--fp8-recipe delayed``, TransformerEngine's ``DelayedScaling``):
tensorwise FP8 whose scales come from an amax HISTORY of earlier optimizer steps, not from
the tensor being cast, so the cast needs no amax reduction in front of it (on a GPU the amax
is taken during or after the cast, off the critical path; here it is a separate reduction
after the cast, the same numbers).

Per FP8 linear, one ``DelayedScaling`` holds a history for each of its three quantized
operands (``OPERANDS``: the input, the weight, the output gradient), ``history_len`` amaxes,
column 0 the most recent step (TE's ``amax_history`` rotates the same way):

- **During a step** every quantization of an operand casts with the encode scale of the
  history and records the operand's local amax into ``pending`` (a MAX over the step's
  microbatches, and over recomputation: the same values).
- **The scale**: ``amax = history[0]`` (``most_recent``) or ``history.max()`` (``max``), then
  ``encode = max_fp8 / amax / 2^margin`` (1 where that amax is 0), quantize.py's rule.
- **Evaluation** casts with the histories too; what it records is dropped when the next
  training step begins (``begin_step``), so eval intervals do not change training's scales
  (a weight's amax is kept with its cached FP8 copy and recorded at each use, so a copy
  evaluation made still counts for the step that reuses it).
- **At the step boundary** (``step_delayed_scaling``, after the backward and before the
  optimizer step, whose FP8 weight gather casts with the new histories) each
  ``pending`` is MAX all-reduced over the groups given (the training loop gives the TP group
  and the DP x CP group: a sharded operand's amax is its whole tensor's, as current scaling's
  TP all-reduce makes it, and every replica then holds the same history and so the same
  scales, which keeps DP replicas bitwise identical), pushed in at column 0, and the oldest
  amax drops out.
- **The first step** (no step recorded yet, ``steps == 0``) uses current scaling: each
  operand's own amax, TP-reduced where sharded, exactly the tensorwise recipe. TE instead
  starts from scale 1, which flushes small gradients to zero and saturates large
  activations on step 1; initializing from the first cast's amax is the rule of torchao's
  predecessor float8_experimental (``_maybe_initialize_amaxes_for_float8_cast``: "if the
  amax buffers are not initialized, initializes them" from the tensor, with a distributed
  reduction "to match numerics between single GPU and multi GPU").

The histories are training state, saved in checkpoints as plain data by a name every layout
gives a linear (``named_states``: its layer's global number and its path in the layer;
``capture_histories``: both formats, in each rank's own record) and restored on a resume, so
a resumed run scales exactly as the uninterrupted one: at the same layout from the rank's
own record, at another (the sharded format) from every saved pipeline stage's records merged
by name. From the torch format at another layout, or a checkpoint without them, they restart
with the first-step rule (a note says so).
They are not model state: a checkpoint with them loads without FP8 and the reverse.
"""
from typing import Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.fp8.quantize import encode_scale

CHECKPOINT_KEY = "fp8_delayed_scaling"  # a checkpoint rank record's key for the histories
OPERANDS = ("input", "weight", "grad")


def history_encode(history: torch.Tensor, algo: str, dtype: torch.dtype,
                   margin: int) -> torch.Tensor:
    """The encode scale (fp32, shape ()) a history gives: quantize.py's rule on the amax
    ``algo`` picks from it."""
    return encode_scale(history[0] if algo == "most_recent" else history.max(), dtype, margin)


class DelayedScaling:
    """One FP8 linear's amax histories (module docstring)."""

    def __init__(self, history_len: int, algo: str):
        """``history_len`` and ``algo`` as Fp8Config checked them."""
        self.algo = algo
        self.history = torch.zeros(len(OPERANDS), history_len)
        self.pending = torch.zeros(len(OPERANDS))
        self.steps = 0

    def _to(self, device: torch.device) -> None:
        if self.history.device != device:
            self.history = self.history.to(device)
            self.pending = self.pending.to(device)

    def encode(self, operand: str, dtype: torch.dtype, margin: int,
               device: torch.device) -> Optional[torch.Tensor]:
        """The encode scale of ``operand`` for this step; None on the first step (current
        scaling)."""
        if self.steps == 0:
            return None
        self._to(device)
        return history_encode(self.history[OPERANDS.index(operand)], self.algo, dtype,
                              margin)

    def record(self, operand: str, amax: torch.Tensor) -> None:
        self._to(amax.device)
        i = OPERANDS.index(operand)
        torch.maximum(self.pending[i], amax.float(), out=self.pending[i])

    def begin_step(self) -> None:
        """A training step starts: what evaluation recorded since the last step is dropped
        (its casts use the histories and leave them alone)."""
        self.pending.zero_()

    def roll(self, pending: Optional[torch.Tensor] = None) -> None:
        """End of a step: ``pending`` (default this state's own) becomes the most recent
        amax of each history."""
        new = self.pending if pending is None else pending.to(self.pending.device)
        self.history = torch.cat([new[:, None], self.history[:, :-1]], dim=1)
        self.pending = torch.zeros_like(self.pending)
        self.steps += 1

    def state_dict(self) -> dict:
        """Plain data (JSON and ``weights_only`` safe; fp32 values round-trip exactly
        through Python floats)."""
        return {"history": self.history.cpu().tolist(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        history = torch.tensor(state["history"], dtype=torch.float32)
        if history.shape != self.history.shape:
            raise ValueError(f"the checkpoint's FP8 amax history has shape "
                             f"{tuple(history.shape)}, this run's {tuple(self.history.shape)}: "
                             f"resume with the same --fp8-amax-history-len")
        self.history = history.to(self.history.device)
        self.pending = torch.zeros_like(self.pending)
        self.steps = int(state["steps"])


def delayed_states(modules: Iterable[torch.nn.Module]) -> List[DelayedScaling]:
    """The DelayedScaling of every FP8 linear in ``modules``, in module order (the same order
    on every rank of a pipeline stage)."""
    states = []
    for module in modules:
        for layer in module.modules():
            state = getattr(getattr(layer, "fp8", None), "delayed", None)
            if isinstance(state, DelayedScaling):
                states.append(state)
    return states


def named_states(modules: Iterable[torch.nn.Module]) -> Dict[str, DelayedScaling]:
    """Each delayed-scaling linear's state by a name every layout gives it: the path of its
    transformer layer's list, the layer's global number (``layer_number``, the outermost
    module on the path that has one) and the path inside the layer, e.g.
    ``decoder.layers[3].self_attention.linear_qkv``."""
    named = {}
    for module in modules:
        submodules = dict(module.named_modules())
        for path, layer in submodules.items():
            state = getattr(getattr(layer, "fp8", None), "delayed", None)
            if not isinstance(state, DelayedScaling):
                continue
            parts, key = path.split("."), path
            for end in range(1, len(parts)):
                number = getattr(submodules[".".join(parts[:end])], "layer_number", None)
                if number is not None:
                    key = ".".join(parts[:end - 1]) + f"[{number}]." + ".".join(parts[end:])
                    break
            named[key] = state
    return named


def capture_histories(modules: Iterable[torch.nn.Module]) -> Optional[Dict[str, dict]]:
    """What a checkpoint saves: each delayed-scaling linear's state by name (the same on
    every TP and DP rank of a pipeline stage); None without delayed scaling."""
    named = named_states(modules)
    return {name: s.state_dict() for name, s in named.items()} if named else None


def restore_histories(modules: Iterable[torch.nn.Module], saved) -> bool:
    """Put the histories of this rank's linears back from ``saved``: ``capture_histories``'s
    dict, by name, from any layout (every stage's merged), or an older checkpoint's list in
    module order (the same layout only). False (nothing changed: the histories restart with
    the first-step rule) where one is missing or another model's. True where this run has no
    delayed scaling (a checkpoint's histories are then ignored)."""
    named = named_states(modules)
    if not named:
        return True
    if isinstance(saved, dict):
        pairs = [(state, saved.get(name)) for name, state in named.items()]
    elif isinstance(saved, list) and len(saved) == len(named):
        pairs = list(zip(named.values(), saved))
    else:
        return False
    try:
        for state, entry in pairs:
            if entry is None or torch.tensor(entry["history"]).shape != state.history.shape:
                return False
        for state, entry in pairs:
            state.load_state_dict(entry)
    except (KeyError, TypeError, ValueError):
        return False
    return True


def step_delayed_scaling(states: Sequence[DelayedScaling],
                         groups: Sequence[Optional[dist.ProcessGroup]] = ()) -> None:
    """The step boundary: every state's pending amaxes MAX all-reduced over ``groups`` in one
    collective each, then rolled into the histories."""
    if not states:
        return
    pending = torch.stack([s.pending.to(states[0].pending.device) for s in states])
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=group)
    for state, amax in zip(states, pending):
        state.roll(amax)
