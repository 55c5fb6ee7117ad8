from setuptools import find_packages, setup

setup(
    name="megatron-pretrain",
    version="0.1.0",
    description="A Megatron-style framework for pretraining large language models",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*"]),
    # torch: any release from 2.4 on (2.13.0 included); scripts install it only when missing,
    # because a bare requirement would pull the CUDA wheels onto CPU-only machines.
    install_requires=[
        "torch>=2.4",
        "numpy>=1.24",
        "tokenizers>=0.15",  # GPT-2 BPE in Rust
        "sentencepiece>=0.1.99",  # LLaMA tokenizers
        "transformers>=5.0",  # HF tokenizers and checkpoints (loaded from local paths only)
        "safetensors>=0.4",
        "tensorboard>=2.10",  # training logs (torch.utils.tensorboard writes, tests read back)
        "matplotlib>=3.7",  # tools/plot_pipeline.py draws pipeline timelines (Agg, no display)
    ],
    extras_require={"dev": ["pytest>=7.4"]},
)
