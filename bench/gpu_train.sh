#!/usr/bin/env bash
# Training throughput on one GPU, bf16, flash attention and fused kernels on (--fused): a ~125M and a ~1B
# model, this project against transformers and a minimal PyTorch loop, with TFLOP/s, MFU
# (megatron/observability/flops.py) and peak GPU memory. Run on a machine with a CUDA GPU:
#   bash bench/gpu_train.sh                      # both sizes, 3 repeats of 10 steps each
#   GPU_TRAIN_SIZES=125M bash bench/gpu_train.sh --repeats 1 --steps 4 --time-budget 120
# Arguments are appended to every run (the later of two equal flags wins); GPU_TRAIN_SIZES picks the runs,
# PYTHON the interpreter (default: python).
# Every table is printed even when a run fails (its row says FAILED, the reason follows the table); the
# label of this project's row names what its 'flash' layers ran (flash-attn, or PyTorch SDPA without it).
# The exit code is 1 when any run failed, and the last line names them.
set -uo pipefail
cd "$(dirname "$0")/.."
declare -A RUNS=(
    [125M]="--size large --seq 2048 --batch 8 --precision bf16 --steps 10 --warmup 3 --repeats 3 --fused"
    [1B]="--size 1B --seq 2048 --batch 4 --precision bf16 --steps 10 --warmup 3 --repeats 3 --fused"
)
failed=()
for size in ${GPU_TRAIN_SIZES:-125M 1B}; do
    if [[ -z "${RUNS[$size]:-}" ]]; then
        echo "GPU_TRAIN_SIZES: unknown size '$size' (known: ${!RUNS[*]})" >&2
        exit 2
    fi
    echo "=== $size: ${PYTHON:-python} bench/train_throughput.py ${RUNS[$size]} $*"
    # shellcheck disable=SC2086  # RUNS holds space-separated flags
    "${PYTHON:-python}" bench/train_throughput.py ${RUNS[$size]} "$@"
    status=$?
    [[ $status -eq 0 ]] || failed+=("$size (exit $status)")
done
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "gpu_train.sh: failed: ${failed[*]}"
    exit 1
fi
echo "gpu_train.sh: all runs finished"
