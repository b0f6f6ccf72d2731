"""triton_support: device checks, block sizes, and a clear error when TRITON_INTERPRET changes after import."""
import sys

import pytest
import torch

from megatron.fused_kernels import launch_config, triton_support


def test_next_power_of_2():
    assert [triton_support.next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]


def test_elementwise_programs_cover_all_elements():
    assert launch_config.elementwise_programs(1) == 1
    assert launch_config.elementwise_programs(1024) == 1
    assert launch_config.elementwise_programs(1025) == 2


def test_check_device_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="'rotary'.*CUDA"):
        triton_support.check_device(torch.zeros(1), "rotary")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_support.check_device(torch.zeros(1), "rotary")


def test_changing_interpreter_mode_after_import_is_a_clear_error(monkeypatch):
    imported_interpreted = triton_support.triton_language_interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "0" if imported_interpreted else "1")
    with pytest.raises(RuntimeError, match="when triton was first imported"):
        triton_support.load_kernels("swiglu")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if imported_interpreted else "0")
    assert triton_support.load_kernels("swiglu").BUILT_FOR_INTERPRETER is imported_interpreted


def test_missing_kernel_package_message(monkeypatch):
    monkeypatch.setattr(triton_support, "triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="requirements-triton.txt"):
        triton_support.load_kernels("swiglu")


def test_compiled_kernel_report_reads_the_jit_caches(monkeypatch):
    """What the GPU check prints after the kernel table: registers and spills of each compiled kernel."""
    from types import ModuleType, SimpleNamespace

    compiled = SimpleNamespace(src=SimpleNamespace(fn=SimpleNamespace(arg_names=["x", "BLOCK"]), constants={(1,): 64}),
                               metadata=SimpleNamespace(num_warps=4), n_regs=40, n_spills=0)
    module = ModuleType("megatron.fused_kernels.triton_kernels.fake")
    module.fake_kernel = SimpleNamespace(device_caches={0: ({"key": compiled}, "target", "backend", "binder")})
    module.not_a_kernel = 3
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert triton_support.compiled_kernel_report() == [
        {"kernel": "fake_kernel", "constexprs": {"BLOCK": 64}, "num_warps": 4, "registers": 40, "spilled": 0}
    ]
