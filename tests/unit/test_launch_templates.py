"""The launch templates (shtools/launch/) and example configs (shtools/configs/): every script
parses (bash -n); every config, sourced in bash, gives flags that parse_args + build_configs accept
at the world size it is meant for (the Megatron-LLaMA one flag for flag equal to
tests/unit/test_arguments.py LAUNCH; every config parsed and planned as shipped:
test_config_planning.py); each launcher
builds the torchrun command it documents (DRY_RUN=1); and single_node.sh really trains
gpt_small.sh, scaled down by extra flags, on 2 CPU processes."""
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from megatron.training.arguments import build_configs, parse_args
from tests.unit.test_arguments import LAUNCH

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "shtools", "**", "*.sh"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "shtools", "**", "*.sbatch"), recursive=True))
# Every config shipped, by name: a new one is covered by the tests over all of them.
CONFIGS = {os.path.basename(path)[:-len(".sh")]: path
           for path in sorted(glob.glob(os.path.join(ROOT, "shtools", "configs", "*.sh")))}
LAUNCHERS = ("single_node.sh", "multi_node.sh", "elastic.sh", "slurm.sbatch")


def clean_env(**overrides):
    """A minimal environment (no TP, DATA_PATH, ... leaking in from the caller's) + overrides."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "PYTHONPATH") if k in os.environ}
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def source_config(config, **env):
    """(ENTRY_POINT, TRAIN_ITERS, CONFIG_FLAGS) of a config sourced in bash with ``env``."""
    proc = subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source "$1"; '
                       'printf "%s\\0" "$ENTRY_POINT" "$TRAIN_ITERS" "${CONFIG_FLAGS[@]}"',
         "bash", config], env=clean_env(**env), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    entry, train_iters, *flags = proc.stdout.split("\0")[:-1]
    return entry, int(train_iters), flags


def configs_of(flags, world_size):
    return build_configs(parse_args(flags), world_size)


@pytest.fixture
def files(tmp_path):
    """Empty stand-ins for the data, tokenizer and GPT-2 vocab files the configs name."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("D1", "D2", "D3", "corpus_text_document"):
        for ext in (".bin", ".idx"):
            (data / f"{name}{ext}").write_bytes(b"")
    (tmp_path / "tok").mkdir()
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return dict(d=str(data), tok=str(tmp_path / "tok"), ck=str(tmp_path / "ck"),
                tb=str(tmp_path / "tb"), vocab=str(tmp_path / "vocab.json"),
                merges=str(tmp_path / "merges.txt"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_every_template_documents_its_variables():
    for path in [os.path.join(ROOT, "shtools", "launch", n) for n in LAUNCHERS] + list(
            CONFIGS.values()):
        text = open(path).read()
        head = re.match(r"(?:#.*\n|\n)*", text).group(0)  # the comment block at the top
        assert "---- variables (environment variables override them" in head, path
        for var in set(re.findall(r"^([A-Z_]+)=\$\{\1:-", text, re.M)):
            assert re.search(rf"^#.*\b{var}\b", head, re.M), (path, var)


def test_gpt_small_mock_data(files):
    entry, train_iters, flags = source_config(CONFIGS["gpt_small"])
    assert entry == "pretrain_gpt.py" and train_iters == 2000 and "--mock-data" in flags
    assert "--save" not in flags  # no CHECKPOINT_DIR: no checkpoints
    cfg = configs_of(flags, world_size=1)
    t = cfg.transformer
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.ffn_hidden_size) == (
        12, 768, 12, 3072)
    assert t.position_embedding_type == "learned_absolute" and t.activation == "gelu_tanh"
    assert t.normalization == "LayerNorm" and t.add_bias_linear
    assert cfg.model_kwargs["share_embeddings_and_output_weights"] and cfg.dataset.mock
    assert cfg.training.global_batch_size == 32 and cfg.training.train_iters == 2000


def test_gpt_small_real_data_and_checkpoints(files):
    _, _, flags = source_config(
        CONFIGS["gpt_small"], DATA_PATH=f"{files['d']}/corpus_text_document",
        VOCAB_FILE=files["vocab"], MERGE_FILE=files["merges"], CHECKPOINT_DIR=files["ck"],
        TENSORBOARD_DIR=files["tb"], TP=2, PP=2, MICRO_BATCH=2, GLOBAL_BATCH=16)
    cfg = configs_of(flags, world_size=8)
    tr = cfg.training
    assert not cfg.dataset.mock and "--tokenizer-type" in flags and "GPT2BPETokenizer" in flags
    assert tr.save == tr.load == files["ck"] and tr.tensorboard_dir == files["tb"]
    assert (cfg.transformer.tensor_model_parallel_size,
            cfg.transformer.pipeline_model_parallel_size, tr.data_parallel_size) == (2, 2, 2)


def test_llama2_7b(files):
    env = dict(DATA_PATH=f"{files['d']}/corpus_text_document", TOKENIZER_DIR=files["tok"],
               CHECKPOINT_DIR=files["ck"], TENSORBOARD_DIR=files["tb"])
    entry, train_iters, flags = source_config(CONFIGS["llama2_7b"], **env)
    assert entry == "pretrain_llama.py" and train_iters == 500000
    cfg = configs_of(flags, world_size=8)  # one node of 8 GPUs: TP 2 x DP 4
    t, o, d, tr = cfg.transformer, cfg.optimizer, cfg.ddp, cfg.training
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.ffn_hidden_size) == (
        32, 4096, 32, 11008)
    assert t.num_query_groups in (None, 32) and t.kv_channels == 128
    assert t.max_position_embeddings == 4096 and cfg.dataset.seq_length == 4096
    assert t.normalization == "RMSNorm" and t.layernorm_epsilon == 1e-5
    assert t.activation == "swiglu" and t.position_embedding_type == "rope"
    assert t.rotary_base == 10000 and not t.add_bias_linear
    assert not cfg.model_kwargs["share_embeddings_and_output_weights"]
    assert (t.tensor_model_parallel_size, t.pipeline_model_parallel_size) == (2, 1)
    # No selective recomputation: with flash attention it would save nothing.
    assert t.sequence_parallel and t.recompute_granularity is None
    assert o.bf16 and o.use_distributed_optimizer and d.overlap_grad_reduce
    assert d.overlap_param_gather
    assert (o.lr, o.min_lr, o.adam_beta2, o.adam_eps, o.weight_decay) == (
        3e-4, 3e-5, 0.95, 1e-5, 0.1)
    s = cfg.scheduler_kwargs
    assert s["lr_decay_style"] == "cosine" and s["lr_warmup_steps"] == 2000 * 1024
    assert (tr.micro_batch_size, tr.global_batch_size, tr.data_parallel_size) == (1, 1024, 4)
    assert tr.save == tr.load == files["ck"]  # auto-resume
    assert "PretrainedFromHF" in flags and flags[flags.index("--tokenizer-name-or-path") + 1] \
        == files["tok"]
    # TP=1: no --sequence-parallel (it needs TP > 1); 16 GPUs.
    _, _, flags = source_config(CONFIGS["llama2_7b"], TP=1, **env)
    assert "--sequence-parallel" not in flags
    assert configs_of(flags, world_size=16).training.data_parallel_size == 16


def test_llama_13b_is_the_megatron_llama_flag_set(files):
    _, train_iters, flags = source_config(
        CONFIGS["llama_13b_megatron_llama"], DATA_DIR=files["d"], TOKENIZER_DIR=files["tok"],
        CHECKPOINT_DIR=files["ck"], TENSORBOARD_DIR=files["tb"], JOB_NAME="NAME")
    # Less selective recomputation, which saves nothing with flash attention.
    want = shlex.split(LAUNCH.format(**files))
    for flag in ("--recompute-activations", "--recompute-granularity", "selective"):
        want.remove(flag)
    assert flags == want and train_iters == 1000
    cfg = configs_of(flags, world_size=8)
    assert cfg.training.data_parallel_size == 4 and cfg.transformer.num_layers == 40


def dry_run(launcher, args=(), **env):
    """The command a launcher would run (DRY_RUN=1), split into words."""
    proc = subprocess.run(["bash", os.path.join(ROOT, "shtools", "launch", launcher), *args],
                          env=clean_env(DRY_RUN=1, **env), cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def split_command(words, entry):
    """(launcher words, Megatron flags) around the entry point's path."""
    at = words.index(os.path.join(ROOT, entry))
    return words[:at], words[at + 1:]


def option(words, name):
    return words[words.index(name) + 1]


def test_single_node_command():
    words = dry_run("single_node.sh", ["--train-iters", "7"], GPUS_PER_NODE=4,
                    CONFIG="shtools/configs/gpt_small.sh")
    launcher, flags = split_command(words, "pretrain_gpt.py")
    assert launcher[0] == "torchrun" and "--standalone" in launcher
    assert option(launcher, "--nproc-per-node") == "4"
    assert flags[-2:] == ["--train-iters", "7"]  # "$@" last: overrides the config
    assert configs_of(flags, world_size=4).training.train_iters == 7


def test_multi_node_command(files):
    words = dry_run("multi_node.sh", NNODES=2, GPUS_PER_NODE=8, MASTER_ADDR="node0",
                    MASTER_PORT=1234, JOB_ID="run42", CONFIG=CONFIGS["llama2_7b"],
                    DATA_PATH=f"{files['d']}/corpus_text_document", TOKENIZER_DIR=files["tok"])
    launcher, flags = split_command(words, "pretrain_llama.py")
    assert (option(launcher, "--nnodes"), option(launcher, "--nproc-per-node")) == ("2", "8")
    assert option(launcher, "--rdzv-backend") == "c10d"
    assert option(launcher, "--rdzv-endpoint") == "node0:1234"
    assert option(launcher, "--rdzv-id") == "run42"
    assert configs_of(flags, world_size=16).training.data_parallel_size == 8


def test_elastic_command(files):
    words = dry_run("elastic.sh", MIN_NODES=2, MAX_NODES=4, GPUS_PER_NODE=8, MAX_RESTARTS=5,
                    MASTER_ADDR="node0", CONFIG=CONFIGS["gpt_small"], CHECKPOINT_DIR=files["ck"],
                    MICRO_BATCH=1, GLOBAL_BATCH=96)  # 96: a multiple of 16, 24 and 32
    launcher, flags = split_command(words, "pretrain_gpt.py")
    assert option(launcher, "--nnodes") == "2:4" and option(launcher, "--max-restarts") == "5"
    assert option(launcher, "--rdzv-backend") == "c10d"
    assert option(launcher, "--rdzv-endpoint") == "node0:29500"
    for world in (16, 24, 32):  # every world size in MIN..MAX takes the same global batch
        tr = configs_of(list(flags), world_size=world).training
        assert tr.save == tr.load == files["ck"] and tr.global_batch_size == 96


def test_slurm_command(files):
    words = dry_run("slurm.sbatch", ["--log-interval", "5"], SLURM_JOB_ID=777, SLURM_NNODES=4,
                    SLURM_GPUS_ON_NODE=8, SLURM_SUBMIT_DIR=ROOT, MASTER_ADDR="gpu-001",
                    CONFIG="shtools/configs/llama2_7b.sh",
                    DATA_PATH=f"{files['d']}/corpus_text_document", TOKENIZER_DIR=files["tok"],
                    CHECKPOINT_DIR=files["ck"])
    launcher, flags = split_command(words, "pretrain_llama.py")
    assert launcher[0] == "srun" and "--ntasks-per-node=1" in launcher and "torchrun" in launcher
    assert (option(launcher, "--nnodes"), option(launcher, "--nproc-per-node")) == ("4", "8")
    assert option(launcher, "--rdzv-endpoint") == "gpu-001:29500"
    assert option(launcher, "--rdzv-id") == "777"
    assert "--exit-signal-handler" in flags and flags[-2:] == ["--log-interval", "5"]
    cfg = configs_of(flags, world_size=32)
    assert cfg.training.save == cfg.training.load == files["ck"]
    assert cfg.training.exit_signal_handler
    sbatch = open(os.path.join(ROOT, "shtools", "launch", "slurm.sbatch")).read()
    assert re.search(r"^#SBATCH --signal=(B:)?TERM@\d+$", sbatch, re.M)
    assert re.search(r"^#SBATCH --nodes=\d+$", sbatch, re.M)
    assert re.search(r"^#SBATCH --gpus-per-node=\d+$", sbatch, re.M)
    assert re.search(r"^#SBATCH --time=", sbatch, re.M)


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_single_node_trains_gpt_small_on_cpu(tmp_path):
    """The smoke test of gpt_small.sh: 2 CPU processes (data parallel 2), mock data, tiny sizes
    given as extra flags, 2 iterations, a final checkpoint."""
    checkpoints = tmp_path / "ck"
    env = clean_env(CONFIG="shtools/configs/gpt_small.sh", GPUS_PER_NODE=2,
                    TORCHRUN=f"{sys.executable} -m torch.distributed.run",
                    MEGATRON_DEVICE="cpu", OMP_NUM_THREADS=1, TRAIN_ITERS=2, MICRO_BATCH=2,
                    GLOBAL_BATCH=4, CHECKPOINT_DIR=checkpoints)
    extra = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--vocab-size 64 --eval-iters 1 --device cpu --num-workers 0").split()
    proc = subprocess.run(["bash", "shtools/launch/single_node.sh", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    iterations = re.findall(r" iteration +(\d+)/ *(\d+) \|", proc.stdout)
    assert iterations == [("1", "2"), ("2", "2")], proc.stdout[-3000:]
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.parametrize("reached, expect_requeue, expect_rc", [
    (100, True, 0),      # preempted / time limit at iteration 100 of 500: requeue, resume
    (500, False, 0),     # finished
    (None, False, 1),    # failed before any checkpoint: no requeue loop, srun's status
])
def test_slurm_requeues_until_the_checkpoint_reaches_train_iters(
        files, tmp_path, reached, expect_requeue, expect_rc):
    """slurm.sbatch after srun returns, with stand-ins for srun (writes the tracker a run would
    leave, exits 1 as torchrun does after SIGTERM) and scontrol (records its arguments)."""
    bin_dir, checkpoints, log = tmp_path / "bin", tmp_path / "ck", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    checkpoints.mkdir()
    write = f"echo {reached} > {checkpoints}/latest_checkpointed_iteration.txt; " if reached \
        else ""
    (bin_dir / "srun").write_text(f"#!/bin/bash\n{write}exit 1\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {log}\n')
    for tool in ("srun", "scontrol"):
        os.chmod(bin_dir / tool, 0o755)
    env = clean_env(SLURM_JOB_ID=777, SLURM_NNODES=1, SLURM_SUBMIT_DIR=ROOT,
                    MASTER_ADDR="localhost", CONFIG=CONFIGS["llama2_7b"], TRAIN_ITERS=500,
                    DATA_PATH=f"{files['d']}/corpus_text_document", TOKENIZER_DIR=files["tok"],
                    CHECKPOINT_DIR=checkpoints)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    proc = subprocess.run(["bash", os.path.join(ROOT, "shtools", "launch", "slurm.sbatch")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == expect_rc, proc.stderr
    requeued = log.read_text().split() if log.exists() else []
    assert requeued == (["requeue", "777"] if expect_requeue else []), proc.stderr


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launchers_export_cuda_device_max_connections(launcher, files, tmp_path):
    """What the launched command sees: CUDA_DEVICE_MAX_CONNECTIONS=1 (tensor-parallel
    communication overlaps GEMMs only with one hardware queue), even if the caller set it."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "seen"
    bin_dir.mkdir()
    for tool in ("torchrun", "srun"):  # stand-ins that record what the job would get
        (bin_dir / tool).write_text(
            f'#!/bin/bash\necho "${{CUDA_DEVICE_MAX_CONNECTIONS:-unset}}" > {seen}\n')
        os.chmod(bin_dir / tool, 0o755)
    env = clean_env(CUDA_DEVICE_MAX_CONNECTIONS=8, CONFIG=CONFIGS["gpt_small"],
                    CHECKPOINT_DIR=files["ck"], SLURM_JOB_ID=1, SLURM_NNODES=1,
                    SLURM_SUBMIT_DIR=ROOT, MASTER_ADDR="localhost", AUTO_REQUEUE=0)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    subprocess.run(["bash", os.path.join(ROOT, "shtools", "launch", launcher)], env=env,
                   cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert seen.read_text().strip() == "1"


# name -> (world size of its default layout, (layers, hidden, experts, top-k, expert FFN), EP,
# PP, q/k norm, top-k renormalised after a softmax over all experts)
MOE_CONFIGS = {"mixtral_8x7b": (32, (32, 4096, 8, 2, 14336), 8, 4, False, False),
               "qwen3_moe_small": (16, (48, 2048, 128, 8, 768), 8, 2, True, True)}


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_moe_configs(name, files):
    world, shape, ep, pp, qk_norm, pre_softmax = MOE_CONFIGS[name]
    env = dict(DATA_PATH=f"{files['d']}/corpus_text_document", TOKENIZER_DIR=files["tok"],
               CHECKPOINT_DIR=files["ck"], TENSORBOARD_DIR=files["tb"])
    entry, _, flags = source_config(CONFIGS[name], **env)
    assert entry == "pretrain_llama.py"
    t = configs_of(flags, world_size=world).transformer
    moe = t.moe
    assert (t.num_layers, t.hidden_size, moe.num_moe_experts, moe.moe_router_topk,
            moe.moe_ffn_hidden_size) == shape
    assert (t.expert_model_parallel_size, t.pipeline_model_parallel_size) == (ep, pp)
    assert t.qk_layernorm == qk_norm and moe.moe_router_pre_softmax == pre_softmax
    assert moe.moe_router_topk_norm == pre_softmax and moe.moe_layer_freq == 1


# name -> (layers, hidden, heads, groups, head dim, FFN, q/k norm, q/k/v bias, embedding rows,
# the published parameter count: HF's model.num_parameters() of the released checkpoint)
DENSE_QWEN = {"qwen3_8b": (36, 4096, 32, 8, 128, 12288, True, False, 151936, 8_190_735_360),
              "qwen2_5_7b": (28, 3584, 28, 4, 128, 18944, False, True, 152064, 7_615_616_512)}


@pytest.mark.parametrize("name", DENSE_QWEN)
def test_dense_qwen_configs_have_the_published_shape(name, files):
    from megatron.training.memory.params import chunk_param_shapes

    layers, hidden, heads, groups, d, ffn, qk_norm, qkv_bias, rows, count = DENSE_QWEN[name]
    env = dict(DATA_PATH=f"{files['d']}/corpus_text_document", TOKENIZER_DIR=files["tok"],
               CHECKPOINT_DIR=files["ck"], TENSORBOARD_DIR=files["tb"])
    entry, _, flags = source_config(CONFIGS[name], **env)
    assert entry == "pretrain_llama.py"
    t = configs_of(flags, world_size=8).transformer  # TP 2 x DP 4 by default
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.num_query_groups,
            t.kv_channels, t.ffn_hidden_size) == (layers, hidden, heads, groups, d, ffn)
    assert (t.qk_layernorm, bool(t.add_qkv_bias), t.add_bias_linear) == (qk_norm, qkv_bias,
                                                                         False)
    assert t.rotary_base == 1e6 and t.layernorm_epsilon == 1e-6 and t.sequence_parallel
    assert flags[flags.index("--padded-vocab-size") + 1] == str(rows)
    _, _, flags = source_config(CONFIGS[name], TP=1, **env)
    whole = configs_of(flags, world_size=1).transformer
    assert sum(s.numel for s in chunk_param_shapes(
        whole, rows, 0, 0, share_embeddings_and_output_weights=False)) == count


def test_gpt_oss_20b_config_has_the_published_shape(files):
    """Every gpt-oss feature on, the published shape, and the parameter count of HF's
    GptOssForCausalLM of that shape (built on the meta device: 20,914,757,184)."""
    import transformers as T
    from megatron.training.memory.params import chunk_param_shapes

    env = dict(DATA_PATH=f"{files['d']}/corpus_text_document", TOKENIZER_DIR=files["tok"],
               CHECKPOINT_DIR=files["ck"], TENSORBOARD_DIR=files["tb"])
    entry, _, flags = source_config(CONFIGS["gpt_oss_20b"], **env)
    assert entry == "pretrain_llama.py"
    t = configs_of(flags, world_size=8).transformer
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.num_query_groups,
            t.kv_channels) == (24, 2880, 64, 8, 64)
    assert (t.moe.num_moe_experts, t.moe.moe_router_topk, t.moe.moe_ffn_hidden_size) == \
        (32, 4, 2880)
    assert t.expert_model_parallel_size == 8 and t.expert_tensor_parallel_size == 1
    assert t.window_size == (127, 0) and t.window_attn_skip_freq == 2
    assert t.softmax_type == "learnable" and t.activation == "quick_geglu"
    assert (t.glu_linear_offset, t.activation_func_clamp_value) == (1.0, 7.0)
    assert t.rope_type == "yarn" and t.rotary_scaling_factor == 32 and not t.yarn_truncate
    assert t.moe.moe_router_bias and t.add_bias_linear and t.add_qkv_bias
    hf = T.GptOssConfig(num_hidden_layers=24, hidden_size=2880, intermediate_size=2880,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                        sliding_window=128, tie_word_embeddings=False)
    with torch.device("meta"):
        count = sum(p.numel() for p in T.GptOssForCausalLM(hf).parameters())
    _, _, flags = source_config(CONFIGS["gpt_oss_20b"], EP=1, **env)
    whole = configs_of(flags, world_size=1).transformer
    assert sum(s.numel for s in chunk_param_shapes(
        whole, 201088, 0, 0, share_embeddings_and_output_weights=False)) == count


# name -> (its default world size, HF DeepseekV3Config fields of the shape, MTP depths)
DEEPSEEK = {
    "deepseek_v3": (1024, {}, 1),  # transformers' defaults are DeepSeek-V3's shape
    "deepseek_v3_small": (8, dict(
        num_hidden_layers=16, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        first_k_dense_replace=1), 1)}


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_configs_have_the_published_shape(name, files):
    """The flags build DeepSeek-V3's design (MLA, dense first layers, grouped sigmoid routing,
    the shared expert) and, MTP aside, the parameter count of HF's DeepseekV3ForCausalLM of
    that shape (built on the meta device; 671,026,404,352 for DeepSeek-V3)."""
    import transformers as T
    from megatron.training.memory.params import chunk_param_shapes

    world, fields, mtp = DEEPSEEK[name]
    env = dict(DATA_PATH=f"{files['d']}/corpus_text_document", TOKENIZER_DIR=files["tok"],
               CHECKPOINT_DIR=files["ck"], TENSORBOARD_DIR=files["tb"])
    entry, _, flags = source_config(CONFIGS[name], **env)
    assert entry == "pretrain_llama.py"
    t = configs_of(flags, world_size=world).transformer
    hf = T.DeepseekV3Config(**fields)
    assert t.multi_latent_attention and t.qk_layernorm and t.rotary_interleaved
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.q_lora_rank,
            t.kv_lora_rank, t.qk_head_dim, t.qk_pos_emb_head_dim, t.v_head_dim) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.q_lora_rank,
        hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)
    moe = t.moe
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size,
            moe.moe_router_num_groups, moe.moe_router_group_topk) == (
        hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.n_group,
        hf.topk_group)
    assert moe.moe_layer_freq[:hf.first_k_dense_replace + 1] == \
        [0] * hf.first_k_dense_replace + [1]
    assert moe.moe_router_score_function == "sigmoid" and moe.moe_router_enable_expert_bias
    assert t.mtp_num_layers == mtp
    with torch.device("meta"):
        count = sum(p.numel() for p in T.DeepseekV3ForCausalLM(hf).parameters())
    _, _, flags = source_config(CONFIGS[name], TP=1, PP=1, EP=1, FIRST_STAGE_LAYERS="",
                                LAST_STAGE_LAYERS="", **env)
    whole = configs_of(flags, world_size=1).transformer
    shapes = chunk_param_shapes(whole, hf.vocab_size, 0, 0,
                                share_embeddings_and_output_weights=False)
    assert sum(s.numel for s in shapes if not s.name.startswith("mtp.")) == count
