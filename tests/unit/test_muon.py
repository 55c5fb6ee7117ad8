"""Muon (--optimizer muon) against torch.optim.Muon + torch.optim.AdamW, and at TP=2 against one
process.

One process: our Muon with the NS iteration in bf16 is bitwise torch.optim.Muon (the same ops
in the same order) for the scale modes torch has ("original" = shape_scaling, "match_rms_adamw"
= spectral x 0.2), and the rest is bitwise torch's fused AdamW. In fp32 (our default) the
iteration is torch's with the bf16 casts left out: checked against torch.optim.Muon whose
iteration is ours, and the result is near-orthogonal.
TP=2: the whole matrix is orthogonalized, not the shard: with the same gradient the update is
bitwise the one-process one; through a model (gradients summed in another order over the TP
shards) within 1e-6.
"""
import pytest
import torch

from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models import LlamaModel, llama_config
from megatron.core.models.tp_sharding import merge_state_dicts
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_param_groups
from megatron.core.optimizer import muon
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.distributed import run_distributed
from tests.unit.test_optimizer import _forward_step

VOCAB, SEQ, MBS = 64, 16, 2
MUON_LEAVES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
               "linear_fc2.weight")


def _llama(seed=42, sequence_parallel=False, dtype=torch.float32):
    torch.manual_seed(seed)
    return LlamaModel(llama_config(
        num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=48, max_position_embeddings=SEQ, sequence_parallel=sequence_parallel,
        params_dtype=dtype), VOCAB)


def _batches(steps, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
             torch.randint(0, VOCAB, (MBS, SEQ), generator=g)) for _ in range(steps)]


def _config(**muon_kw):
    kw = dict(optimizer="muon", lr=2e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
              clip_grad=0.0)
    kw.update(muon_kw)
    return OptimizerConfig(**kw)


def _steps(model, optimizer, batches) -> None:
    """One optimizer step per batch, through the schedule (which finalizes the gradients:
    sequence-parallel norms' over TP, DP's reduction)."""
    for batch in batches:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter([batch]), model=[model],
            num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS)
        optimizer.step()


def _ours(config, steps, sequence_parallel=False):
    """Our optimizer on the tiny LLaMA in DDP, through the schedule (which finalizes the
    gradients: sequence-parallel norms' over TP)."""
    model = _llama(sequence_parallel=sequence_parallel)
    model.config.finalize_model_grads_func = finalize_model_grads
    model = DDP(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(config, [model])
    _steps(model, optimizer, _batches(steps))
    return model.module, optimizer


def _torch_reference(config, steps, adjust_lr_fn):
    """torch.optim.Muon on the layers' matrices, fused AdamW on the rest, in the wrapper's
    two weight-decay groups."""
    model = _llama()
    names = {p: n for n, p in model.named_parameters()}
    muon_groups, adam_groups = [], []
    for g in get_param_groups([model]):
        wd = config.weight_decay * g["wd_mult"]
        mats = [p for p in g["params"] if names[p].endswith(MUON_LEAVES)]
        rest = [p for p in g["params"] if not names[p].endswith(MUON_LEAVES)]
        muon_groups += [{"params": mats, "weight_decay": wd}] if mats else []
        adam_groups += [{"params": rest, "weight_decay": wd}] if rest else []
    torch_muon = torch.optim.Muon(muon_groups, lr=config.lr, momentum=config.muon_momentum,
                                  nesterov=config.muon_use_nesterov,
                                  ns_steps=config.muon_num_ns_steps, adjust_lr_fn=adjust_lr_fn)
    adamw = torch.optim.AdamW(adam_groups, lr=config.lr, eps=config.adam_eps, fused=True,
                              betas=(config.adam_beta1, config.adam_beta2))
    for tokens, labels in _batches(steps):
        for opt in (torch_muon, adamw):
            opt.zero_grad(set_to_none=True)
        model(tokens, labels=labels).float().mean().backward()
        torch_muon.step()
        adamw.step()
    return model, torch_muon, adamw


def _one_process_vs_torch(scale_mode, extra, adjust_lr_fn, nesterov, ns_dtype):
    config = _config(muon_scale_mode=scale_mode, muon_extra_scale_factor=extra,
                     muon_use_nesterov=nesterov, muon_ns_dtype=ns_dtype)
    ours, optimizer = _ours(config, steps=3)
    ref, torch_muon, adamw = _torch_reference(config, 3, adjust_lr_fn)
    ours_params, ref_params = dict(ours.named_parameters()), dict(ref.named_parameters())
    muon_names = sorted(optimizer._names[p].split("/", 1)[1]
                        for g in optimizer.param_groups if g["use_muon"] for p in g["params"])
    mismatched = [n for n in ours_params if not torch.equal(ours_params[n], ref_params[n])]
    state_mismatch = []
    for name, p in ref_params.items():
        torch_state = (torch_muon.state if name in muon_names else adamw.state)[p]
        our_state = optimizer.optimizer.state[ours_params[name]]
        for key, value in torch_state.items():
            if key != "step" and not torch.equal(value, our_state[key]):
                state_mismatch.append((name, key))
    return muon_names, mismatched, state_mismatch


@pytest.mark.parametrize("scale_mode,extra,adjust_lr_fn,nesterov", [
    ("shape_scaling", 1.0, "original", True),
    ("spectral", 0.2, "match_rms_adamw", False),
])
def test_bf16_iteration_is_bitwise_torch_muon_and_adamw(scale_mode, extra, adjust_lr_fn,
                                                        nesterov):
    names, mismatched, state_mismatch = run_distributed(
        _one_process_vs_torch, world_size=1, tp=1, scale_mode=scale_mode, extra=extra,
        adjust_lr_fn=adjust_lr_fn, nesterov=nesterov, ns_dtype=torch.bfloat16)[0]
    assert names == sorted(f"decoder.layers.{i}.{kind}" for i in range(2) for kind in
                           ("self_attention.linear_qkv.weight",
                            "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
                            "mlp.linear_fc2.weight"))
    assert mismatched == [] and state_mismatch == []


def _fp32_vs_torch_with_our_iteration():
    """torch.optim.Muon with its NS iteration replaced by ours in fp32: the rest of the
    arithmetic (momentum, nesterov, decay, scale) is then the same op for op."""
    import torch.optim._muon as torch_muon_module
    original = torch_muon_module._zeropower_via_newtonschulz
    torch_muon_module._zeropower_via_newtonschulz = \
        lambda grad, coefficients, steps, eps: muon.newton_schulz(grad, steps, torch.float32,
                                                                  coefficients, eps)
    try:
        return _one_process_vs_torch("shape_scaling", 1.0, "original", True, torch.float32)
    finally:
        torch_muon_module._zeropower_via_newtonschulz = original


def test_fp32_iteration_is_torch_muon_without_the_bf16_casts():
    _, mismatched, state_mismatch = run_distributed(
        _fp32_vs_torch_with_our_iteration, world_size=1, tp=1)[0]
    assert mismatched == [] and state_mismatch == []


def test_newton_schulz_bf16_is_torch_and_fp32_is_near_orthogonal():
    from torch.optim._muon import _zeropower_via_newtonschulz
    g = torch.Generator().manual_seed(0)
    for shape in ((24, 40), (40, 24)):
        x = torch.randn(shape, generator=g)
        ref = _zeropower_via_newtonschulz(x, muon.NS_COEFFICIENTS, 5, muon.NS_EPS)
        assert torch.equal(muon.newton_schulz(x, 5, torch.bfloat16), ref)
        before = x.clone()
        singular = torch.linalg.svdvals(muon.newton_schulz(x, 5))
        assert torch.equal(x, before)  # the input (a momentum buffer) is left alone
        # the quintic's fixed band: singular values pushed into ~[0.7, 1.2], not to 1
        assert 0.6 < singular.min() and singular.max() < 1.25, singular


def test_scale_modes():
    assert muon.scale_factor("shape_scaling", 96, 32) == pytest.approx(3 ** 0.5)
    assert muon.scale_factor("shape_scaling", 32, 96) == 1.0
    assert muon.scale_factor("spectral", 32, 96) == pytest.approx(96 ** 0.5)
    assert muon.scale_factor("unit_rms_norm", 32, 128) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="--muon-scale-mode"):
        muon.scale_factor("blockwise", 2, 2)


# --- tensor parallelism --------------------------------------------------------------------

def _train_full_params(config, steps, sequence_parallel=False):
    from megatron.core import parallel_state
    model, _ = _ours(config, steps, sequence_parallel)
    return (parallel_state.get_tensor_model_parallel_rank(),
            {n: p.detach().clone() for n, p in model.named_parameters()})


def _tp_vs_one_process(sequence_parallel, split_qkv=False):
    """At lr 1e-3 (an update of ~1e-2 per element): the TP gradients are sums in another
    order, and Newton-Schulz's quintic (slope 3.4 at 0, five times) amplifies such rounding in
    the small singular directions: the updates agree to ~1e-5 relative, 1e-6 absolute."""
    config = dict(muon_split_qkv=split_qkv, muon_use_nesterov=True, lr=1e-3)
    one = run_distributed(_train_full_params, world_size=1, tp=1, config=_config(**config),
                          steps=3)[0][1]
    shards = run_distributed(_train_full_params, world_size=2, tp=2, config=_config(**config),
                             steps=3, sequence_parallel=sequence_parallel)
    merged = merge_state_dicts([s for _, s in sorted(shards, key=lambda r: r[0])],
                               gated_mlp=True)
    init = run_distributed(_train_full_params, world_size=1, tp=1, config=_config(),
                           steps=0)[0][1]
    for name, full in one.items():
        # the update itself within 1e-6, not only the weights
        assert (merged[name] - init[name] - (full - init[name])).abs().max() < 1e-6, name
        assert not torch.equal(full, init[name]), name


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_updates_equal_one_process(sequence_parallel):
    _tp_vs_one_process(sequence_parallel)


def test_tp2_split_qkv_equals_one_process():
    _tp_vs_one_process(False, split_qkv=True)


def _same_gradient_sharded(stride, dim, qkv):
    """A whole matrix and its TP shards (cut as initialize_affine_weight cuts) given the same
    gradient: the shard's update must be bitwise the whole matrix's update's shard."""
    from megatron.core import parallel_state
    rank, size = parallel_state.get_tensor_model_parallel_rank(), 2
    g = torch.Generator().manual_seed(5)
    full_w, full_g = torch.randn(48, 32, generator=g), torch.randn(48, 32, generator=g)

    def cut(t):
        return torch.cat(t.chunk(stride * size, dim=dim)[rank::size], dim=dim)
    layout = muon.MatrixLayout(None, qkv=qkv)
    tp_layout = muon.MatrixLayout(parallel_state.get_tensor_model_parallel_group(), dim,
                                  stride, qkv=qkv)
    results = []
    for weight, grad, lay in ((full_w, full_g, layout), (cut(full_w), cut(full_g), tp_layout),
                              (cut(full_w), cut(full_g), muon.MatrixLayout())):  # alone
        p = torch.nn.Parameter(weight.clone())
        opt = muon.MuonWithAdamW([{"params": [p], "use_muon": True}], {p: lay}, lr=0.1,
                                 weight_decay=0.1, nesterov=True)
        for _ in range(2):
            p.grad = grad.clone()
            opt.step()
        results.append(p.detach())
    # orthogonalizing the shard alone (a "blockwise" mode) is another update altogether
    return torch.equal(cut(results[0]), results[1]) and \
        (results[2] - results[1]).abs().max().item() > 1e-2


@pytest.mark.parametrize("stride,dim,qkv", [(1, 0, None), (2, 0, None), (1, 1, None),
                                            (1, 0, (4, 8, 2))])
def test_tp2_shard_update_is_bitwise_the_whole_matrix_update(stride, dim, qkv):
    assert run_distributed(_same_gradient_sharded, world_size=2, tp=2, stride=stride,
                           dim=dim, qkv=qkv) == [True, True]


# --- experts: E matrices per stacked weight, gathered over expert TP -------------------------

def _experts_etp2_vs_whole_vs_torch():
    """SwiGLUExperts' stacked [E, 2f, h] / [E, h, f] weights: at expert-TP 2 (cut apart in
    gate and up) the update is bitwise the whole weights' update's shard; the whole weights'
    update (NS in bf16) is bitwise torch.optim.Muon's on each expert's matrix alone."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import ExpertShard, SwiGLUExperts
    parallel_state.initialize_expert_parallel(1, 2)
    experts = []
    for shard in (None, ExpertShard()):  # expert TP 2 (from parallel_state), then whole
        torch.manual_seed(3)
        experts.append(SwiGLUExperts(4, 16, 12, shard=shard))
    etp, whole = experts
    g = torch.Generator().manual_seed(8)
    grads = (torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g))
    ref = [torch.nn.Parameter(w[e].detach().clone()) for w in (whole.weight1, whole.weight2)
           for e in range(4)]
    torch_muon = torch.optim.Muon(ref, lr=0.05, weight_decay=0.1, nesterov=False)
    ours = []
    for module, dtype in ((etp, torch.bfloat16), (whole, torch.bfloat16)):
        params = [module.weight1, module.weight2]
        opt = muon.MuonWithAdamW([{"params": params, "use_muon": True}],
                                 muon.matrix_layouts([module], False), lr=0.05,
                                 weight_decay=0.1, scale_mode="shape_scaling", ns_dtype=dtype)
        ours.append(opt)
    for _ in range(2):
        for (module, opt), (g1, g2) in zip(zip((etp, whole), ours),
                                           (etp.shard.cut(*grads), grads)):
            module.weight1.grad, module.weight2.grad = g1.clone(), g2.clone()
            opt.step()
        for p, grad in zip(ref, [grads[0][e] for e in range(4)] + [grads[1][e] for e in range(4)]):
            p.grad = grad.clone()
        torch_muon.step()
    cut1, cut2 = etp.shard.cut(whole.weight1.detach(), whole.weight2.detach())
    return (torch.equal(cut1, etp.weight1), torch.equal(cut2, etp.weight2),
            torch.equal(torch.stack(ref[:4]), whole.weight1),
            torch.equal(torch.stack(ref[4:]), whole.weight2))


def test_experts_at_expert_tp2_and_per_expert_are_bitwise():
    for rank, result in enumerate(run_distributed(_experts_etp2_vs_whole_vs_torch,
                                                  world_size=2, tp=2)):
        assert result == (True, True, True, True), rank


# --- data parallelism: the distributed optimizer ---------------------------------------------

def _train_dp(config, steps, distributed):
    """The tiny LLaMA at DP x TP, each DP rank on its own data; returns (TP rank, DP rank,
    this rank's params, the optimizer's named state on DP rank 0)."""
    from megatron.core import parallel_state
    dp_rank = parallel_state.get_data_parallel_rank()
    model = _llama(dtype=config.params_dtype)
    model.config.finalize_model_grads_func = finalize_model_grads
    model = DDP(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, bucket_size=3000,  # several buckets
        grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(config, [model])
    _steps(model, optimizer, _batches(steps, seed=11 + dp_rank))
    state = optimizer.state_dict()
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    owned = sum(p.numel() for p, rank in optimizer.optimizer.sharded.owner.items()
                if rank == dp_rank) if distributed else None
    return (parallel_state.get_tensor_model_parallel_rank(), dp_rank, params,
            state["params"] if dp_rank == 0 else None, owned)


@pytest.mark.parametrize("tp,dtype,ns_dtype", [(1, torch.float32, torch.float32),
                                               (2, torch.float32, torch.float32),
                                               (1, torch.bfloat16, torch.float32),
                                               (1, torch.float32, torch.bfloat16)])
def test_distributed_optimizer_is_bitwise_the_replicated_one(tp, dtype, ns_dtype):
    """DP=2 (x TP): each matrix orthogonalized by its owner rank, pieces reduce-scattered,
    equals every replica orthogonalizing it (the same reduced gradients: bitwise); bf16:
    the fp32 main copies, shards of them or whole; NS in bf16: the exchange in bf16."""
    runs = {}
    for distributed in (False, True):
        config = _config(muon_use_nesterov=True, use_distributed_optimizer=distributed,
                         muon_split_qkv=tp == 2, bf16=dtype == torch.bfloat16,
                         params_dtype=dtype, muon_ns_dtype=ns_dtype)
        runs[distributed] = run_distributed(_train_dp, world_size=2 * tp, tp=tp,
                                            config=config, steps=3, distributed=distributed)
    for plain, sharded in zip(runs[False], runs[True]):
        assert plain[:2] == sharded[:2]
        for name in plain[2]:
            assert torch.equal(plain[2][name], sharded[2][name]), name
        if plain[3] is not None:
            assert plain[3].keys() == sharded[3].keys()
            for name, entry in plain[3].items():
                assert entry.keys() == sharded[3][name].keys(), name
                for key in entry:
                    assert torch.equal(entry[key], sharded[3][name][key]), (name, key)
    momenta = [n for n, e in runs[True][0][3].items() if "momentum_buffer" in e]
    assert len(momenta) == 8, momenta  # 4 matrices x 2 layers
    owned = [run[4] for run in runs[True]]  # the matrices' elements each rank orthogonalizes
    assert min(owned) > 0 and max(owned) - min(owned) <= 3072 // tp, owned  # <= fc1's


def test_distributed_optimizer_at_dp2_equals_one_process():
    """The same data on both DP ranks: the DP mean of equal gradients is the gradient, up
    to the reduction's rounding (<= 1e-6 at lr 1e-3)."""
    config = _config(muon_use_nesterov=True, use_distributed_optimizer=True, lr=1e-3)
    one = run_distributed(_train_full_params, world_size=1, tp=1,
                          config=_config(muon_use_nesterov=True, lr=1e-3), steps=3)[0][1]
    for _, _, params, _, _ in run_distributed(_train_dp_same_data, world_size=2, tp=1,
                                           config=config, steps=3):
        for name, full in one.items():
            assert (params[name] - full).abs().max() < 1e-6, name


def _train_dp_same_data(config, steps):
    from megatron.core import parallel_state
    model = _llama()
    model.config.finalize_model_grads_func = finalize_model_grads
    model = DDP(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                model)
    optimizer = get_megatron_optimizer(config, [model])
    _steps(model, optimizer, _batches(steps))
    return (0, parallel_state.get_data_parallel_rank(),
            {n: p.detach().clone() for n, p in model.module.named_parameters()}, None, None)


# --- checkpoints -----------------------------------------------------------------------------

def _state_round_trip():
    """Two steps, the named state into a fresh optimizer (as a resume does), one more step on
    each: bitwise the same; Muon's matrices hold only their momentum (no Adam step)."""
    import copy
    config = _config(muon_use_nesterov=True)
    model = _llama()  # no DDP: .grad is the gradient
    optimizer = get_megatron_optimizer(config, [model])
    for tokens, labels in _batches(2):
        optimizer.zero_grad()
        model(tokens, labels=labels).float().mean().backward()
        optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())
    twin = copy.deepcopy(model)
    resumed = get_megatron_optimizer(config, [twin])
    resumed.load_state_dict(state)
    for m, opt in ((model, optimizer), (twin, resumed)):
        tokens, labels = _batches(3)[2]
        opt.zero_grad()
        m(tokens, labels=labels).float().mean().backward()
        opt.step()
    muon_state = [resumed.optimizer.state[p] for g in resumed.param_groups if g["use_muon"]
                  for p in g["params"]]
    saved = {name: sorted(entry) for name, entry in state["params"].items()}
    return (all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters())),
            all(sorted(s) == ["momentum_buffer"] for s in muon_state),
            saved["0/decoder.layers.0.mlp.linear_fc1.weight"],
            saved["0/decoder.layers.0.input_layernorm.weight"])


def test_named_state_round_trip_is_bitwise():
    same, only_momentum, matrix_keys, norm_keys = run_distributed(
        _state_round_trip, world_size=1, tp=1)[0]
    assert same and only_momentum
    assert matrix_keys == ["momentum_buffer"] and norm_keys == ["exp_avg", "exp_avg_sq"]


def test_loading_another_optimizers_state_is_refused():
    from megatron.core.optimizer.named_state import optimizer_kind
    muon_groups = [{"use_muon": True, "momentum": 0.95}, {"use_muon": False, "betas": (0.9, 0.95)}]
    assert optimizer_kind(muon_groups) == "muon"
    assert optimizer_kind([{"betas": (0.9, 0.95)}]) == "adam"
    assert optimizer_kind([{"momentum": 0.9}]) == "sgd"


def test_muon_flags_reach_the_optimizer_config():
    from megatron.training.arguments import build_configs, parse_args
    from tests.unit.test_arguments import small
    config = build_configs(parse_args(small(
        "--optimizer", "muon", "--muon-momentum", "0.9", "--muon-use-nesterov",
        "--muon-num-ns-steps", "6", "--muon-scale-mode", "shape_scaling",
        "--muon-extra-scale-factor", "0.2", "--muon-split-qkv", "--muon-ns-dtype", "bf16",
        "--muon-tp-mode", "duplicated")),
        1).optimizer
    assert (config.optimizer, config.muon_momentum, config.muon_use_nesterov,
            config.muon_num_ns_steps, config.muon_scale_mode, config.muon_extra_scale_factor,
            config.muon_split_qkv, config.muon_tp_mode, config.muon_ns_dtype) == (
        "muon", 0.9, True, 6, "shape_scaling", 0.2, True, "duplicated", torch.bfloat16)
    default = build_configs(parse_args(small("--optimizer", "muon")), 1).optimizer
    assert (default.muon_momentum, default.muon_use_nesterov, default.muon_num_ns_steps,
            default.muon_scale_mode, default.muon_ns_dtype) == (
        0.95, False, 5, "spectral", torch.float32)
