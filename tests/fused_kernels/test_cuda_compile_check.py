"""Every Triton kernel variant compiles for CUDA (checked ahead of time in a separate process, so
it runs on machines without a GPU)."""
import os
import subprocess
import sys

from tests.fused_kernels.cuda_compile_check import VARIANTS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_kernel_compiles_for_cuda(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "tests.fused_kernels.cuda_compile_check"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert f"{len(VARIANTS)} of {len(VARIANTS)} kernel variants compiled" in result.stdout
