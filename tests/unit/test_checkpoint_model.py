"""training/checkpoint_model.py without processes: a checkpoint's saved args back into a
Namespace (layout from the checkpoint's record unless overridden)."""
import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.checkpoint_model import args_from_checkpoint, read_checkpoint_record
from megatron.training.checkpointing import CheckpointError
from megatron.training.checkpointing.offline import TargetLayout, write_model

FLAGS = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 63 --normalization RMSNorm --swiglu "
         "--ffn-hidden-size 48 --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 "
         "--rotary-base 500000 --use-rope-scaling --rope-scaling-factor 4 --norm-epsilon 1e-6 "
         "--lr-decay-iters 100 --lr-warmup-iters 2 --weight-decay 0.1").split()


def _model_state(num_layers=4, hidden=32, heads=4, groups=2, ffn=48, vocab=64):
    """Full tensors with this project's names (LLaMA-like: GQA, SwiGLU, untied output)."""
    d = hidden // heads
    shapes = {"embedding.word_embeddings.weight": (vocab, hidden),
              "decoder.final_layernorm.weight": (hidden,), "output_layer.weight": (vocab, hidden)}
    for i in range(num_layers):
        shapes.update({f"decoder.layers.{i}.{k}": v for k, v in {
            "input_layernorm.weight": (hidden,),
            "self_attention.linear_qkv.weight": ((heads + 2 * groups) * d, hidden),
            "self_attention.linear_proj.weight": (hidden, heads * d),
            "pre_mlp_layernorm.weight": (hidden,),
            "mlp.linear_fc1.weight": (2 * ffn, hidden),
            "mlp.linear_fc2.weight": (hidden, ffn)}.items()})
    return {name: torch.randn(shape) for name, shape in shapes.items()}


@pytest.fixture
def saved(tmp_path):
    """A checkpoint whose args are a whole training run's (as pretrain saves vars(args)),
    written at TP=2 x PP=2 x VPP=2."""
    args = vars(parse_args(FLAGS + ["--tensor-model-parallel-size", "2",
                                    "--pipeline-model-parallel-size", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "1"]))
    root = tmp_path / "ckpt"
    write_model(str(root), _model_state(), 4, 64, True, False, TargetLayout(2, 2, 2), args,
                iteration=6)
    return root


def test_saved_args_come_back_with_the_checkpoints_layout(saved):
    saved_args, layout = read_checkpoint_record(str(saved))
    assert saved_args["num_layers"] == 4 and layout["virtual_pipeline_model_parallel_size"] == 2
    args = args_from_checkpoint(str(saved))
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size) == (2, 2, 2)
    assert args.load == str(saved) and args.lr == 1e-3 and args.lr_decay_iters == 100
    assert args.start_weight_decay == args.end_weight_decay == 0.1  # re-derived, no error
    assert args.use_rope_scaling and args.rope_scaling_factor == 4.0
    assert args.num_query_groups == 2 and args.rotary_base == 500000.0


def test_layout_overrides_replace_the_whole_layout(saved):
    args = args_from_checkpoint(str(saved), overrides={"tensor_model_parallel_size": 4})
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size) == (4, 1, None)
    args = args_from_checkpoint(str(saved), overrides={
        "pipeline_model_parallel_size": 4, "num_layers_per_virtual_pipeline_stage": 1})
    assert args.virtual_pipeline_model_parallel_size == 1


def test_model_only_takes_the_model_flags_alone(saved):
    args = args_from_checkpoint(str(saved), overrides={"micro_batch_size": 1, "lr": 0.0,
                                                      "train_iters": 1}, model_only=True)
    assert args.lr_decay_iters is None and args.global_batch_size is None  # defaults
    assert args.num_layers == 4 and args.swiglu and args.tokenizer_type == "NullTokenizer"


def test_not_a_checkpoint_of_this_project(tmp_path, saved):
    with pytest.raises(CheckpointError, match="no such directory"):
        args_from_checkpoint(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="--ckpt-step 3.*it has: \\[6\\]"):
        args_from_checkpoint(str(saved), ckpt_step=3)
    rank_file = saved / "iter_0000006" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(rank_file, weights_only=True)
    torch.save({**state, "args": None}, rank_file)
    with pytest.raises(CheckpointError, match="does not record its model's flags"):
        args_from_checkpoint(str(saved))
