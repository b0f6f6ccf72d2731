"""The fused-kernel benchmark (what bench/gpu_check.py prints): every op has cases, both candidates of each
case run and agree with fp32 PyTorch, and a row says when the measurement disagrees with the CUDA choice."""
import math

import torch

from megatron.fused_kernels import PYTORCH, TRITON, kernel_candidates
from megatron.fused_kernels.benchmark import Row, cases, compare


def test_every_op_has_real_and_small_cases():
    ops = {c.op for c in kernel_candidates()}
    assert {case.op for case in cases("cpu", small=True)} == ops
    real = cases("meta")  # shapes only: nothing is allocated until make()
    assert {case.op for case in real} == ops
    assert any("32768" in case.label for case in real) and any("12288" in case.label for case in real)


def test_small_cases_run_both_candidates_and_match_fp32(device):
    candidates = {c.op: c for c in kernel_candidates()}
    for case in cases(device, small=True):
        torch.manual_seed(0)
        row = compare(case, candidates[case.op], timer=lambda fn: (fn(), math.nan)[1])
        errors = row.errors_triton + row.errors_pytorch
        assert case.time_only or (errors and max(errors) < 2e-2), (case.label, errors)
        assert row.flag_runs == candidates[case.op].on_cuda and "flag runs" in row.line()


def test_row_says_when_the_other_candidate_is_faster():
    row = Row("layer_norm", (1e-3,), (1e-3,), ms_triton=0.10, ms_pytorch=0.20, flag_runs=PYTORCH)
    assert row.faster() == TRITON and "flip cuda_choice" in row.line()
    close = Row("layer_norm", (), (), ms_triton=0.198, ms_pytorch=0.20, flag_runs=PYTORCH)
    assert close.faster() == PYTORCH and "flip" not in close.line() and "time only" in close.line()
    assert Row("x", (), (), math.nan, math.nan, TRITON).faster() == TRITON
