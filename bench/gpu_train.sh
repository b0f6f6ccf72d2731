#!/usr/bin/env bash
# Training throughput on one GPU, bf16, flash attention and fused kernels on (--fused): a ~125M and a ~1B
# model, this project against transformers and a minimal PyTorch loop, with TFLOP/s, MFU
# (megatron/flops.py) and peak GPU memory. Run on a machine with a CUDA GPU:
#   bash bench/gpu_train.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python bench/train_throughput.py --size large --seq 2048 --batch 8 --precision bf16 --steps 10 --warmup 3 --repeats 3 --fused
python bench/train_throughput.py --size 1B --seq 2048 --batch 4 --precision bf16 --steps 10 --warmup 3 --repeats 3 --fused
