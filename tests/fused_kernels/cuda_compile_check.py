"""Compile every Triton kernel variant for CUDA (sm_80 PTX and cubin) ahead of time, no GPU needed.

Run as ``python -m tests.fused_kernels.cuda_compile_check`` with TRITON_INTERPRET unset, in a
process of its own (Triton's interpreter mode is fixed at import); prints one line per variant
and exits 1 if any fails. The interpreter is more permissive than the compiler (e.g. about
non-constexpr globals), so this catches on CPU what would otherwise only fail on a GPU.
"""
import sys
import traceback

from megatron.fused_kernels import triton_support

F32, BF16, I32, I64, U8 = "*fp32", "*bf16", "*i32", "*i64", "*u8"

# (kernel module, kernel, argument types in order, constexpr values)
VARIANTS = [
    ("softmax", "causal_softmax_forward", [BF16, BF16, "fp32", "i32", "i32"], {"BLOCK": 2048}),
    (
        "softmax", "masked_softmax_forward",
        [BF16, U8, BF16, "fp32", "i32", "i32", "i32", "i32", "i32", "i32", "i32"],
        {"FILL": -10000.0, "HAS_MASK": True, "BLOCK": 128},
    ),
    (
        "softmax", "softmax_backward",
        [F32, F32, F32, U8, "fp32", "i32", "i32", "i32", "i32", "i32", "i32", "i32"],
        {"HAS_MASK": True, "BLOCK": 128},
    ),
    (
        "norms", "norm_forward", [BF16, BF16, BF16, BF16, F32, F32, "i32", "fp32"],
        {"IS_RMS": False, "HAS_WEIGHT": True, "HAS_BIAS": True, "BLOCK": 1024},
    ),
    (
        "norms", "norm_forward", [BF16, BF16, BF16, BF16, F32, F32, "i32", "fp32"],
        {"IS_RMS": True, "HAS_WEIGHT": True, "HAS_BIAS": False, "BLOCK": 1024},
    ),
    (
        "norms", "norm_backward", [BF16, BF16, BF16, F32, F32, BF16, F32, F32, "i32", "i32"],
        {"IS_RMS": False, "HAS_WEIGHT": True, "HAS_BIAS": True, "BLOCK": 1024},
    ),
    (
        "norms", "norm_backward", [F32, F32, F32, F32, F32, F32, F32, F32, "i32", "i32"],
        {"IS_RMS": True, "HAS_WEIGHT": False, "HAS_BIAS": False, "BLOCK": 1024},
    ),
    (
        "rotary", "rotary_kernel", [BF16, F32, F32, BF16, "i32", "i32", "i32", "i32", "i32", "i32"],
        {"SEQ_FIRST": False, "BACKWARD": False, "HAS_PASS": True, "BLOCK_ROT": 16, "BLOCK_PASS": 64},
    ),
    (
        "rotary", "rotary_kernel", [F32, F32, F32, F32, "i32", "i32", "i32", "i32", "i32", "i32"],
        {"SEQ_FIRST": True, "BACKWARD": True, "HAS_PASS": False, "BLOCK_ROT": 64, "BLOCK_PASS": 1},
    ),
    ("bias_gelu", "bias_gelu_forward", [BF16, BF16, BF16, "i32", "i32"], {"HAS_BIAS": True, "EXACT": False, "BLOCK": 1024}),
    ("bias_gelu", "bias_gelu_forward", [F32, F32, F32, "i32", "i32"], {"HAS_BIAS": False, "EXACT": True, "BLOCK": 1024}),
    (
        "bias_gelu", "bias_gelu_backward", [BF16, BF16, BF16, BF16, "i32", "i32"],
        {"HAS_BIAS": True, "EXACT": False, "BLOCK": 1024},
    ),
    (
        "bias_gelu", "bias_gelu_backward", [F32, F32, F32, F32, "i32", "i32"],
        {"HAS_BIAS": False, "EXACT": True, "BLOCK": 1024},
    ),
    (
        "bias_dropout_add", "bias_dropout_add_forward", [BF16, BF16, BF16, BF16, I32, "i32", "i32", "fp32", "fp32"],
        {"HAS_BIAS": True, "DROPOUT": True, "BLOCK": 1024},
    ),
    ("bias_dropout_add", "dropout_backward", [BF16, BF16, I32, "i32", "fp32", "fp32"], {"BLOCK": 1024}),
    ("swiglu", "swiglu_forward", [BF16, BF16, BF16, "i32", "i32", "i32", "i32"], {"BLOCK": 1024}),
    ("swiglu", "swiglu_backward", [BF16, BF16, BF16, BF16, BF16, "i32", "i32", "i32", "i32"], {"BLOCK": 1024}),
    ("cross_entropy", "cross_entropy_forward", [BF16, I64, F32, F32, "i32", "i32", "i32"], {"BLOCK": 4096}),
    ("cross_entropy", "cross_entropy_backward", [BF16, I64, F32, F32, BF16, "i32", "i32", "i32"], {"BLOCK": 4096}),
]


def compile_variant(module_name: str, kernel_name: str, arg_types: list, constexprs: dict) -> None:
    """Compile one kernel with the given argument types and constexpr values (raises on error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(triton_support.load_kernels(module_name), kernel_name)
    runtime_args = [name for name in kernel.arg_names if name not in constexprs]
    if len(runtime_args) != len(arg_types):
        raise ValueError(f"{kernel_name}: {len(arg_types)} types for arguments {runtime_args}")
    types = {**dict(zip(runtime_args, arg_types)), **{name: "constexpr" for name in constexprs}}
    signature = {name: types[name] for name in kernel.arg_names}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 80, 32)
    )
    if ".entry" not in compiled.asm["ptx"] or not compiled.asm["cubin"]:
        raise RuntimeError(f"{kernel_name}: no PTX entry or cubin produced")


def main() -> int:
    failures = 0
    for module_name, kernel_name, arg_types, constexprs in VARIANTS:
        try:
            compile_variant(module_name, kernel_name, arg_types, constexprs)
            print(f"ok {module_name}.{kernel_name} {constexprs}")
        except Exception:  # report every variant, then fail
            failures += 1
            print(f"FAILED {module_name}.{kernel_name} {constexprs}\n{traceback.format_exc()}")
    print(f"{len(VARIANTS) - failures} of {len(VARIANTS)} kernel variants compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
