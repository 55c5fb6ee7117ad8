"""The router's balancing losses do not depend on how a micro batch is split.

- Over TP ranks under sequence parallelism (each rank routes its slice of every sequence and
  returns its share): the shares of the Switch aux loss, the per-sequence aux loss and the
  z-loss add up to the one-process value of the whole micro batch.
- Over micro batches: the per-sequence aux loss and the z-loss of a batch are the mean of
  those of its micro batches (the Switch aux loss is defined per micro batch, as Megatron's
  aux_loss, so it is not expected to be).
Tolerance 1e-6 relative: the same terms, summed in another order."""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.moe.router import (
    aux_loss_scores,
    route,
    seq_aux_loss,
    switch_aux_loss,
    z_loss,
)
from tests.distributed import run_distributed

SEQ, BATCH, EXPERTS, TOPK = 8, 4, 6, 2


def _logits():
    return torch.randn(SEQ * BATCH, EXPERTS, generator=torch.Generator().manual_seed(5))


def _losses(logits, num_sequences, group=None):
    scores = aux_loss_scores(logits, "softmax")
    _, indices = route(logits, TOPK)
    return torch.stack([switch_aux_loss(scores, indices, EXPERTS, group),
                        seq_aux_loss(scores, indices, EXPERTS, num_sequences, group),
                        z_loss(logits, group)])


def _tp_shares():
    tp, rank = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_rank())
    tokens = _logits().view(SEQ, BATCH, EXPERTS)  # tokens ordered [s, b]
    part = SEQ // tp
    mine = tokens[rank * part:(rank + 1) * part].reshape(-1, EXPERTS)
    shares = _losses(mine, BATCH, parallel_state.get_tensor_model_parallel_group())
    dist.all_reduce(shares, group=parallel_state.get_tensor_model_parallel_group())
    return shares


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shares_add_up_to_the_whole_micro_batch(tp):
    whole = _losses(_logits(), BATCH)
    for shares in run_distributed(_tp_shares, world_size=tp, tp=tp):
        torch.testing.assert_close(shares, whole, rtol=1e-6, atol=0)


def test_seq_aux_and_z_loss_are_means_over_micro_batches():
    tokens = _logits().view(SEQ, BATCH, EXPERTS)
    whole = _losses(tokens.reshape(-1, EXPERTS), BATCH)
    halves = [_losses(tokens[:, b:b + 2].reshape(-1, EXPERTS), 2) for b in (0, 2)]
    mean = (halves[0] + halves[1]) / 2
    torch.testing.assert_close(mean[1:], whole[1:], rtol=1e-6, atol=0)
