from setuptools import find_packages, setup

setup(
    name="megatron-pretrain",
    version="0.1.0",
    description="A Megatron-style framework for pretraining large language models",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*"]),
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
    extras_require={"dev": ["pytest>=7.4"]},
)
