"""Model behaviour under tensor parallelism that HF cannot tell us: initial weights that do
not depend on TP or pipeline layout, recomputation, partition rules, and bad configurations."""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.models import GPTModel, LlamaModel, llama_config
from megatron.core.models.tp_sharding import (
    merge_state_dicts,
    partition_of,
    select_layers,
    shard_state_dict,
)
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer import TransformerConfig
from tests.distributed import run_distributed

VOCAB = 64


def _llama(**overrides):
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                ffn_hidden_size=48, max_position_embeddings=32,
                tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    return llama_config(**{**base, **overrides})


def _initial_full_state(layer_range=None, pre_process=True, post_process=True):
    torch.manual_seed(42)
    model = LlamaModel(_llama(), VOCAB, layer_range=layer_range, pre_process=pre_process,
                       post_process=post_process)
    local = {k: v.detach() for k, v in model.state_dict().items()}
    shards = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(shards, local, group=ps.get_tensor_model_parallel_group())
    return merge_state_dicts(shards, gated_mlp=True)


def test_initial_weights_do_not_depend_on_tp_or_layer_range():
    (full,) = run_distributed(_initial_full_state, world_size=1, tp=1)
    for tp in (2, 4):
        merged = run_distributed(_initial_full_state, world_size=tp, tp=tp)[0]
        assert merged.keys() == full.keys()
        for name in full:
            assert torch.equal(merged[name], full[name]), f"TP={tp}: {name}"
    # A later pipeline stage holding layers 2..3 starts with the same layers 2..3.
    (stage,) = run_distributed(_initial_full_state, world_size=1, tp=1, layer_range=(2, 4),
                               pre_process=False)
    want = select_layers(full, (2, 4), pre_process=False, post_process=True, tied_output=False)
    assert stage.keys() == want.keys()
    for name in want:
        assert torch.equal(stage[name], want[name]), name


def _partition_rules_match_model():
    mismatches = []
    for config in (_llama(), TransformerConfig(num_layers=1, hidden_size=32,
                                               num_attention_heads=4)):
        model = GPTModel(config, VOCAB, share_embeddings_and_output_weights=False)
        gated = config.activation == "swiglu"
        for name, p in model.named_parameters():
            declared = (p.partition_dim, p.partition_stride) \
                if getattr(p, "tensor_model_parallel", False) else None
            if partition_of(name, gated) != declared:
                mismatches.append((name, partition_of(name, gated), declared))
        full = {}  # a random full state dict: local shapes with the split dimension x TP
        for name, local in model.state_dict().items():
            shape = list(local.shape)
            if partition_of(name, gated):
                shape[partition_of(name, gated)[0]] *= 2
            full[name] = torch.randn(shape)
        shards = [shard_state_dict(full, 2, r, gated) for r in range(2)]
        back = merge_state_dicts(shards, gated)
        mismatches += [k for k in full if not torch.equal(full[k], back[k])]
    return mismatches


def test_partition_rules_agree_with_the_layers():
    assert run_distributed(_partition_rules_match_model, world_size=2, tp=2) == [[], []]


def test_shard_merge_round_trip_with_stride():
    full = torch.arange(48.).view(8, 6)
    shards = [shard_state_dict({"decoder.layers.0.mlp.linear_fc1.weight": full}, 2, r, True)
              for r in range(2)]
    # Rank 0 holds gate rows 0-1 and up rows 4-5; rank 1 gate rows 2-3 and up rows 6-7.
    assert torch.equal(shards[0]["decoder.layers.0.mlp.linear_fc1.weight"], full[[0, 1, 4, 5]])
    assert torch.equal(merge_state_dicts(shards, True)["decoder.layers.0.mlp.linear_fc1.weight"],
                       full)


RECOMPUTE_MODES = {
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2),
    "full_block_3": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=3),
    "selective": dict(recompute_granularity="selective"),
    "full_distributed": dict(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=2, distribute_saved_activations=True),
}


def _gradients(sequence_parallel, mode, dropout_seed=11):
    overrides = dict(attention_dropout=0.2, hidden_dropout=0.2,
                     sequence_parallel=sequence_parallel, **RECOMPUTE_MODES.get(mode, {}))
    torch.manual_seed(3)
    model = LlamaModel(_llama(**overrides), VOCAB).train()
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    model_parallel_manual_seed(dropout_seed)
    loss = model(tokens, labels=labels)
    loss.mean().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compare_recompute(sequence_parallel):
    base_loss, base_grads = _gradients(sequence_parallel, None)
    result = {}
    for mode in RECOMPUTE_MODES:
        if mode == "full_distributed" and sequence_parallel:
            continue
        loss, grads = _gradients(sequence_parallel, mode)
        result[mode] = torch.equal(loss, base_loss) and all(
            torch.equal(grads[n], base_grads[n]) for n in base_grads)
    # Dropout is really on: another seed changes the loss.
    other_loss = _gradients(sequence_parallel, None, dropout_seed=12)[0]
    result["dropout_active"] = not torch.equal(other_loss, base_loss)
    return result


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recomputation_gives_identical_gradients(sequence_parallel):
    for result in run_distributed(_compare_recompute, world_size=2, tp=2,
                                  sequence_parallel=sequence_parallel):
        assert all(result.values()), result


def _bad_configs():
    messages = []
    for overrides in (dict(num_attention_heads=6, num_query_groups=6, hidden_size=36),
                      dict(num_attention_heads=8, num_query_groups=2)):
        try:
            LlamaModel(_llama(**overrides), VOCAB)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_bad_configurations_fail_at_construction():
    messages = run_distributed(_bad_configs, world_size=4, tp=4)[0]
    assert "num_attention_heads 6 is not divisible by tensor-model-parallel size 4" in messages[0]
    assert "num_query_groups 2 is not divisible by tensor-model-parallel size 4" in messages[1]
    with pytest.raises(ValueError, match="hidden_size 30 is not divisible by num_attention_heads"):
        TransformerConfig(num_layers=1, hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by "
                                         "num_query_groups 3"):
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                          num_query_groups=3)
    with pytest.raises(ValueError, match="full recomputation needs recompute_method"):
        TransformerConfig(recompute_granularity="full")


def _explicit_mask_and_positions():
    torch.manual_seed(5)
    out = {}
    for kind in ("llama", "gpt"):
        if kind == "llama":
            model = LlamaModel(_llama(), VOCAB).eval()
        else:
            model = GPTModel(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                               max_position_embeddings=32), VOCAB).eval()
        tokens = torch.randint(0, VOCAB, (2, 16))
        causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]
        positions = torch.arange(16).unsqueeze(0).expand(2, 16)
        implicit = model(tokens)
        explicit = model(tokens, position_ids=positions, attention_mask=causal)
        # A mask that also hides token 0 from everyone after it changes the result.
        blocked = causal.clone()
        blocked[..., 1:, 0] = True
        out[kind] = ((implicit - explicit).abs().max().item(),
                     (implicit - model(tokens, attention_mask=blocked)).abs().max().item())
    return out


def test_explicit_causal_mask_and_positions_equal_the_defaults():
    for kind, (same, different) in run_distributed(_explicit_mask_and_positions, world_size=2,
                                                   tp=2)[0].items():
        assert same <= 1e-6, kind
        assert different > 1e-3, kind


def _gpt_embeddings(padded_vocab):
    torch.manual_seed(42)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               max_position_embeddings=16,
                               tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    model = GPTModel(config, VOCAB, padded_vocab_size=padded_vocab)
    shards = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(shards, model.embedding.word_embeddings.weight.detach(),
                           group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards)[:VOCAB], model.embedding.position_embeddings.weight.detach()


def test_gpt_initial_embeddings_do_not_depend_on_vocab_padding():
    # Megatron pads the vocabulary to a multiple of 128 x TP, so TP changes the padded size;
    # the position embeddings (and the real vocabulary rows) must not change with it.
    words1, positions1 = run_distributed(_gpt_embeddings, world_size=1, tp=1, padded_vocab=128)[0]
    words2, positions2 = run_distributed(_gpt_embeddings, world_size=2, tp=2, padded_vocab=256)[0]
    assert torch.equal(words1, words2)
    assert torch.equal(positions1, positions2)
