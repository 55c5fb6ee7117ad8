"""A whole LLaMA under context parallelism, one forward and backward through the scripts' loss
and DDP: the reported loss and every parameter's reduced gradient equal one process on the same
batch, at CP = 2 (ring and all-gather) and at TP = 2 x CP = 2 with SP (TP shards merged), with
one document per sample and with packed documents.

Tolerance 1e-6 (relative to the largest gradient entry): CP sums each rank's share of the
loss and the ring merges attention blocks by their log-sum-exp, re-associating fp32 sums;
measured differences are ~1e-8."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models import LlamaModel
from megatron.core.models.llama import llama_config
from megatron.core.models.tp_sharding import merge_state_dicts
from megatron.core.packed_seq_params import packed_seq_params_from_eod
from megatron.training import gpt_step
from megatron.training.data.batch import get_ltor_masks_and_position_ids, shard_for_context_parallel
from megatron.training.training import build_model
from tests.distributed import run_distributed

VOCAB, SEQ, MBS, EOD = 64, 32, 2, 7
TOL = 1e-6


def _config(tp, cp, sp, comm_type):
    return llama_config(num_layers=2, hidden_size=32, num_attention_heads=8,
                        num_query_groups=4, ffn_hidden_size=48, max_position_embeddings=SEQ,
                        tensor_model_parallel_size=tp, context_parallel_size=cp,
                        sequence_parallel=sp, cp_comm_type=comm_type)


def _batch(packed):
    g = torch.Generator().manual_seed(5)
    text = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    _, loss_mask, positions = get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids=packed, reset_attention_mask=packed,
        eod_mask_loss=True, create_attention_mask=False)
    return tokens, labels, loss_mask, positions


def _loss_and_grads(packed, sp=False, comm_type="p2p"):
    tp = ps.get_tensor_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    config = _config(tp, cp, sp, comm_type)
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                        DistributedDataParallelConfig(), seed=42)[0]
    tokens, labels, loss_mask, positions = _batch(packed)
    documents = packed_seq_params_from_eod(tokens, EOD) if packed else None
    assert not packed or len(documents.seqlens) > MBS, "the batch must pack documents"
    tokens, labels, loss_mask, positions = shard_for_context_parallel(
        tokens, labels, loss_mask, positions)
    per_token_loss = model(tokens, position_ids=positions, labels=labels,
                           packed_seq_params=documents)
    loss, reported = gpt_step.loss_func(loss_mask, per_token_loss)
    loss.backward()
    finalize_model_grads([model])  # DP x CP reduction, SP norm gradients over TP
    grads = {name: param.main_grad.detach().clone()
             for name, param in model.module.named_parameters()}
    return float(reported["lm loss"]), grads


@pytest.mark.parametrize("tp, cp, sp, comm_type", [(1, 2, False, "p2p"),
                                                    (2, 2, True, "p2p"),
                                                    (1, 2, False, "all_gather")])
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_model_gradients_under_cp_equal_one_process(tp, cp, sp, comm_type, packed):
    want_loss, want = run_distributed(_loss_and_grads, world_size=1, tp=1, packed=packed)[0]
    results = run_distributed(_loss_and_grads, world_size=tp * cp, tp=tp, cp=cp,
                              packed=packed, sp=sp, comm_type=comm_type)
    for cp_rank in range(cp):  # TP ranks are adjacent: CP rank c holds ranks c*TP .. c*TP+TP-1
        mine = results[cp_rank * tp:(cp_rank + 1) * tp]
        loss = mine[0][0]
        grads = merge_state_dicts([g for _, g in mine], gated_mlp=True)
        assert abs(loss - want_loss) <= TOL * abs(want_loss)
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            scale = want[name].abs().max().item()
            assert scale > 0, name
            err = (grad - want[name]).abs().max().item()
            assert err <= TOL * scale, (name, err, scale)


def _explicit_mask_under_cp():
    config = _config(1, 2, False, "p2p")
    model = LlamaModel(config, VOCAB)
    tokens, _, _, positions = _batch(packed=False)
    tokens, positions = shard_for_context_parallel(tokens, positions)
    mask = torch.ones(1, 1, SEQ // 2, SEQ // 2, dtype=torch.bool).triu(1)
    try:
        model(tokens, position_ids=positions, attention_mask=mask)
    except ValueError as exc:
        return str(exc)


def test_explicit_attention_mask_under_cp_is_a_clear_error():
    messages = run_distributed(_explicit_mask_under_cp, world_size=2, cp=2)
    assert messages == ["context parallelism cannot split an explicit [b, 1, s, s] attention "
                        "mask; pass document boundaries (packed_seq_params) instead, as "
                        "--reset-attention-mask does."] * 2
