from setuptools import find_packages, setup

# `pip install .` installs the commands below. The scripts stay where they are for runs from a
# clone (python pretrain_llama.py, python tools/x.py): the entry scripts are installed as
# top-level modules (so `torchrun -m pretrain_llama` works too) and tools/ as the package
# megatron_tools; the tools' own sys.path lines then point inside site-packages.
COMMANDS = {
    "megatron-pretrain-gpt": "pretrain_gpt:main",
    "megatron-pretrain-llama": "pretrain_llama:main",
    "megatron-preprocess-data": "megatron_tools.preprocess_data:main",
    "megatron-merge-datasets": "megatron_tools.merge_datasets:main",
    "megatron-make-quickstart-corpus": "megatron_tools.make_quickstart_corpus:main",
    "megatron-plan-parallelism": "megatron_tools.plan_parallelism:main",
    "megatron-plot-pipeline": "megatron_tools.plot_pipeline:main",
    "megatron-check-tensor-parallel": "megatron_tools.check_tensor_parallel:main",
    "megatron-convert-checkpoint": "megatron_tools.checkpoint.convert:main",
    "megatron-verify-checkpoint": "megatron_tools.checkpoint.verify:main",
    "megatron-generate": "megatron_tools.checkpoint.generate:main",
}
WANDB = "wandb>=0.16"  # --wandb-project only (imported on use); the tests read its offline runs

setup(
    name="megatron-pretrain",
    version="0.1.0",
    description="A Megatron-style framework for pretraining large language models",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*"]) +
    ["megatron_tools", "megatron_tools.checkpoint"],
    package_dir={"megatron_tools": "tools"},
    py_modules=["pretrain_gpt", "pretrain_llama"],
    entry_points={"console_scripts": [f"{name} = {target}" for name, target in COMMANDS.items()]},
    # torch: 2.11 or newer, the oldest release the tests have been run on (on CPU, 2.11.0
    # and 2.13.0; the GPU tier's machine has 2.11). Scripts install it only when missing or
    # older, because a bare requirement would pull the CUDA wheels onto CPU-only machines.
    install_requires=[
        "torch>=2.11",
        "numpy>=1.24",
        "tokenizers>=0.15",  # GPT-2 BPE in Rust
        "sentencepiece>=0.1.99",  # LLaMA tokenizers
        "transformers>=5.0",  # HF tokenizers and checkpoints (loaded from local paths only)
        "safetensors>=0.4",
        "tensorboard>=2.10",  # training logs (torch.utils.tensorboard writes, tests read back)
        "matplotlib>=3.7",  # tools/plot_pipeline.py draws pipeline timelines (Agg, no display)
        "pyarrow>=14",  # Parquet corpora in tools/preprocess_data.py (row group by row group)
        "zstandard>=0.21",  # .jsonl.zst corpora in tools/preprocess_data.py (streamed)
        "tiktoken>=0.7",  # TikTokenizer, and the GPT-2 BPE fast path (same ids, checked)
    ],
    # setuptools >= 70.1 builds wheels without the "wheel" package: tests/e2e/test_packaging.py
    # runs `pip install --no-build-isolation .` with this Python's setuptools.
    extras_require={"dev": ["pytest>=7.4", "pytest-xdist>=3.5", "setuptools>=70.1", WANDB], "wandb": [WANDB]},
)
