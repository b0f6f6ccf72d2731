"""Compile the Triton kernel configurations the wrappers launch for CUDA (sm_80 and sm_90) ahead of
time, no GPU needed, and fail on any register spill.

Run as ``python -m tests.fused_kernels.cuda_compile_check [--all]`` with TRITON_INTERPRET unset, in
a process of its own (Triton's interpreter mode is fixed at import). Each configuration is what
:mod:`megatron.fused_kernels.launch_config` returns for a width (hidden size, key length,
vocabulary): by default the widths on each side of the edges of those choices (multi-row tiles, the
widest single-block row, the first chunked one; wider rows share the chunked configuration), with
``--all`` every power of two from 16 to 131072 and fp32 inputs as well as bf16. Pointers are compiled as 16-byte
aligned (torch's allocations are) and integer sizes without divisibility hints (odd widths).

Triton runs its bundled ptxas with -v for each compile; its log (registers, spill stores and loads)
is read back. Prints one line per configuration and architecture, with the registers a thread and
the warps an SM that allows, and exits 1 if any configuration fails to compile or spills. The
interpreter is more permissive than the compiler (e.g. about non-constexpr globals), so this also
catches on CPU what would otherwise only fail on a GPU.
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Iterator

from megatron.fused_kernels import launch_config, triton_support

F32, BF16, I32, I64, U8 = "*fp32", "*bf16", "*i32", "*i64", "*u8"
INT, FLOAT = "i32", "fp32"
CAPABILITIES = (80, 90)
REGISTERS_PER_SM, MAX_WARPS_PER_SM = 65536, 64
# The widths each kernel family is compiled at by default, one on each side of every edge of launch_config:
# norms: many rows a tile (96), one row (2048), widest single-block backward (4096) and forward (8192, the
# backward chunked), chunked forward (16384 and up); softmax: a short row, the widest single block (8192),
# chunked (32768 and up); elementwise: many rows a tile, the widest column block; the GPT-NeoX vocabulary.
NORM_WIDTHS = (96, 2048, 4096, 8192, 16384)
SOFTMAX_KEYS = (100, 8192, 32768)
ELEMENTWISE_WIDTHS = (100, 16384)
VOCABULARIES = (50304,)
ALL_WIDTHS = tuple(2**k for k in range(4, 18))


@dataclass(frozen=True)
class Variant:
    """One kernel compile: argument types of the runtime arguments in order, constexprs, warps."""

    module: str
    kernel: str
    arg_types: tuple
    constexprs: tuple  # (name, value) pairs
    num_warps: int

    def describe(self) -> str:
        consts = " ".join(f"{name}={value}" for name, value in self.constexprs)
        return f"{self.module}.{self.kernel} [{self.arg_types[0]}] {consts} warps={self.num_warps}"


def _variant(module: str, kernel: str, arg_types: list, blocks_or_warps, **constexprs) -> Variant:
    warps = blocks_or_warps if isinstance(blocks_or_warps, int) else blocks_or_warps.num_warps
    return Variant(module, kernel, tuple(arg_types), tuple(constexprs.items()), warps)


def norm_variants(width: int, dtype: str) -> Iterator[Variant]:
    d = dtype
    fwd, bwd = launch_config.norm_forward_blocks(width), launch_config.norm_backward_blocks(width)
    layer_norm, rms_norm = dict(IS_RMS=False, HAS_WEIGHT=True, HAS_BIAS=True), dict(IS_RMS=True, HAS_WEIGHT=True,
                                                                                   HAS_BIAS=False)
    for flags in (layer_norm, rms_norm):
        if fwd.chunked:
            yield _variant("norms", "norm_forward_chunked", [d, d, d, d, F32, F32, INT, FLOAT], fwd, **flags,
                           BLOCK_N=fwd.block_n)
        else:
            yield _variant("norms", "norm_forward", [d, d, d, d, F32, F32, INT, INT, FLOAT], fwd, **flags,
                           BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n)
        if bwd.chunked:
            sums = launch_config.column_sum_blocks(width)
            yield _variant("norms", "norm_backward_dx_chunked", [d, d, d, F32, F32, d, INT], bwd,
                           IS_RMS=flags["IS_RMS"], HAS_WEIGHT=True, BLOCK_N=bwd.block_n)
            yield _variant("norms", "norm_backward_dwdb", [d, d, F32, F32, F32, F32, INT, INT], sums, **flags,
                           BLOCK_M=sums.block_m, BLOCK_N=sums.block_n)
        else:
            yield _variant("norms", "norm_backward", [d, d, d, F32, F32, d, F32, F32, INT, INT], bwd, **flags,
                           BLOCK_M=bwd.block_m, BLOCK_N=bwd.block_n)


def softmax_variants(seq_k: int, dtype: str) -> Iterator[Variant]:
    d = dtype
    blocks = launch_config.softmax_blocks(seq_k)
    suffix = "_chunked" if blocks.chunked else ""
    yield _variant("softmax", f"causal_softmax_forward{suffix}", [d, d, FLOAT, INT, INT], blocks, BLOCK=blocks.block_n)
    yield _variant("softmax", f"masked_softmax_forward{suffix}", [d, U8, d, FLOAT] + [INT] * 7, blocks,
                   FILL=-10000.0, HAS_MASK=True, BLOCK=blocks.block_n)
    yield _variant("softmax", f"softmax_backward{suffix}", [d, d, d, U8, FLOAT] + [INT] * 7, blocks,
                   HAS_MASK=True, BLOCK=blocks.block_n)


def elementwise_variants(width: int, dtype: str) -> Iterator[Variant]:
    d = dtype
    b = launch_config.elementwise_blocks(width)
    tile = dict(BLOCK_M=b.block_m, BLOCK_N=b.block_n)
    for exact in (False, True):
        yield _variant("bias_gelu", "bias_gelu_forward", [d, d, d, INT, INT], b, HAS_BIAS=True, EXACT=exact, **tile)
        yield _variant("bias_gelu", "bias_gelu_backward", [d, d, d, d, F32, INT, INT], b, HAS_BIAS=True, EXACT=exact,
                       **tile)
    yield _variant("bias_dropout_add", "bias_dropout_add_forward", [d, d, d, d, I32, INT, INT, FLOAT, FLOAT], b,
                   HAS_BIAS=True, DROPOUT=True, **tile)
    yield _variant("bias_dropout_add", "dropout_backward", [d, d, I32, F32, INT, INT, FLOAT, FLOAT], b,
                   HAS_BIAS=True, **tile)


def cross_entropy_variants(vocab: int, dtype: str) -> Iterator[Variant]:
    d = dtype
    b = launch_config.cross_entropy_blocks(vocab)
    yield _variant("cross_entropy", "cross_entropy_forward", [d, I64, F32, F32, INT, INT, INT], b, BLOCK=b.block_n)
    yield _variant("cross_entropy", "cross_entropy_backward", [d, I64, F32, F32, d, INT, INT, INT], b,
                   BLOCK=b.block_n)


def fixed_variants(dtype: str) -> Iterator[Variant]:
    """The kernels whose launch does not depend on a width (flat elementwise, per-head rotary)."""
    d = dtype
    block = launch_config.ELEMENTWISE_BLOCK
    yield _variant("swiglu", "swiglu_forward", [d, d, d, INT, INT, INT, INT], 4, BLOCK=block)
    yield _variant("swiglu", "swiglu_backward", [d, d, d, d, d, INT, INT, INT, INT], 4, BLOCK=block)
    for seq_first, backward, has_pass, rot, rest in ((False, False, True, 16, 64), (True, True, False, 64, 1)):
        yield _variant("rotary", "rotary_kernel", [d, F32, F32, d] + [INT] * 6, 4, SEQ_FIRST=seq_first,
                       BACKWARD=backward, HAS_PASS=has_pass, BLOCK_ROT=rot, BLOCK_PASS=rest)


def variants(full: bool = False) -> list:
    """Every configuration to compile, without repeats (many widths share one configuration)."""
    dtypes = (BF16, F32) if full else (BF16,)
    found: dict = {}
    for dtype in dtypes:
        families = (
            (norm_variants, ALL_WIDTHS if full else NORM_WIDTHS),
            (softmax_variants, ALL_WIDTHS if full else SOFTMAX_KEYS),
            (elementwise_variants, ALL_WIDTHS if full else ELEMENTWISE_WIDTHS),
            (cross_entropy_variants, ALL_WIDTHS if full else VOCABULARIES),
        )
        for make, widths in families:
            for width in widths:
                found.update(dict.fromkeys(make(width, dtype)))
        found.update(dict.fromkeys(fixed_variants(dtype)))
    return list(found)


@dataclass(frozen=True)
class PtxasReport:
    registers: int
    spill_stores: int
    spill_loads: int

    def warps_per_sm(self, num_warps: int) -> int:
        """Resident warps an SM by registers alone (allocated per warp in units of 256)."""
        per_warp = -(-self.registers * 32 // 256) * 256
        programs = REGISTERS_PER_SM // (per_warp * num_warps)
        return min(MAX_WARPS_PER_SM, programs * num_warps)


def parse_ptxas_log(log: str) -> PtxasReport:
    """Registers and spill bytes from a ``ptxas -v`` log of one kernel."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"no register / spill report in the ptxas log:\n{log}")
    return PtxasReport(int(registers.group(1)), int(spills.group(1)), int(spills.group(2)))


def compile_variant(variant: Variant, capability: int) -> PtxasReport:
    """Compile one configuration for sm_<capability> (raises on error) and read ptxas' report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(variant.constexprs)
    kernel = getattr(triton_support.load_kernels(variant.module), variant.kernel)
    runtime_args = [name for name in kernel.arg_names if name not in constexprs]
    if len(runtime_args) != len(variant.arg_types):
        raise ValueError(f"{variant.kernel}: {len(variant.arg_types)} types for arguments {runtime_args}")
    types = {**dict(zip(runtime_args, variant.arg_types)), **{name: "constexpr" for name in constexprs}}
    signature = {name: types[name] for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*")}
    if not hasattr(triton.knobs.nvidia, "dump_ptxas_log"):
        raise RuntimeError(f"triton {triton.__version__} has no dump_ptxas_log knob to read ptxas' register report "
                           f"from; run this check with the pinned triton (requirements/requirements-triton.txt)")
    triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints its ptxas -v log
    triton.knobs.compilation.always_compile = True  # ... which a cache hit would skip
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned),
            target=GPUTarget("cuda", capability, 32), options={"num_warps": variant.num_warps},
        )
    if ".entry" not in compiled.asm["ptx"] or not compiled.asm["cubin"]:
        raise RuntimeError(f"{variant.kernel}: no PTX entry or cubin produced")
    return parse_ptxas_log(log.getvalue())


def main(argv: list) -> int:
    todo = variants(full="--all" in argv)
    failures = 0
    for variant in todo:
        for capability in CAPABILITIES:
            try:
                report = compile_variant(variant, capability)
            except Exception:  # report every configuration, then fail
                failures += 1
                print(f"FAILED sm_{capability} {variant.describe()}\n{traceback.format_exc()}")
                continue
            spilled = report.spill_stores or report.spill_loads
            failures += bool(spilled)
            status = "SPILLS" if spilled else "ok"
            print(f"{status} sm_{capability} {variant.describe()}: {report.registers} registers, "
                  f"{report.spill_stores}/{report.spill_loads} bytes spilled (stores/loads), "
                  f"{report.warps_per_sm(variant.num_warps)} warps/SM", flush=True)
    total = len(todo) * len(CAPABILITIES)
    print(f"{total - failures} of {total} kernel configurations compiled without spills")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
