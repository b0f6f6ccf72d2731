"""Every Triton kernel configuration the wrappers launch compiles for sm_80 and sm_90 without register
spills (checked ahead of time in a separate process with Triton's bundled ptxas, so it runs on machines
without a GPU). ``python -m tests.fused_kernels.cuda_compile_check --all`` checks every power-of-two
width and fp32 too (282 configurations, a few minutes)."""
import os
import subprocess
import sys

import pytest

from tests.fused_kernels.cuda_compile_check import PtxasReport, Variant, parse_ptxas_log, variants

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PTXAS_LOG = """ptxas info    : Compiling entry function 'norm_backward' for 'sm_90a'
ptxas info    : Function properties for norm_backward
    16 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 64 bytes smem
"""


def test_every_kernel_compiles_for_cuda_without_spills(tmp_path):
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "tests.fused_kernels.cuda_compile_check"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    total = 2 * len(variants())
    assert f"{total} of {total} kernel configurations compiled without spills" in result.stdout


def test_ptxas_report_reads_registers_and_spills():
    report = parse_ptxas_log(PTXAS_LOG)
    assert report == PtxasReport(registers=128, spill_stores=16, spill_loads=12)
    assert report.warps_per_sm(16) == 16  # 128 registers x 512 threads: one program of 16 warps an SM
    assert PtxasReport(55, 0, 0).warps_per_sm(16) == 32
    with pytest.raises(RuntimeError, match="no register"):
        parse_ptxas_log("ptxas info : Compiling entry function 'f'")


def test_sweep_covers_the_chunked_and_widest_single_block_kernels():
    """The default sweep reaches every kernel, and the edges of launch_config (so a block size change there
    is compiled)."""
    from megatron.fused_kernels import launch_config

    default, full = variants(), variants(full=True)
    kernels = {(v.module, v.kernel) for v in default}
    assert kernels == {(v.module, v.kernel) for v in full}
    for chunked in ("norm_forward_chunked", "norm_backward_dx_chunked", "norm_backward_dwdb",
                    "masked_softmax_forward_chunked", "causal_softmax_forward_chunked", "softmax_backward_chunked"):
        assert ("norms" if "norm" in chunked else "softmax", chunked) in kernels
    widest = {(v.kernel, dict(v.constexprs).get("BLOCK_N", dict(v.constexprs).get("BLOCK"))) for v in default}
    assert ("norm_forward", launch_config.NORM_FORWARD_SINGLE_BLOCK) in widest
    assert ("norm_backward", launch_config.NORM_BACKWARD_SINGLE_BLOCK) in widest
    assert ("causal_softmax_forward", launch_config.SOFTMAX_SINGLE_BLOCK) in widest
    assert all(isinstance(v, Variant) for v in default)
