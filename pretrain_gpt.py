"""Pretrain a gpt model: torchrun --nproc-per-node N pretrain_gpt.py [Megatron flags].

Placeholder: the training loop, flags and data pipeline are built by the training-script issue.
"""
import sys

if __name__ == "__main__":
    sys.exit("pretrain_gpt.py: training is not implemented yet (the training-script work item builds "
             "it); run 'bash shtools/quickstart.sh' for what works today.")
