"""GeLU(x + bias), tanh approximation (Megatron's) or exact erf; the backward recomputes
x + bias instead of storing it. Elementwise over flat blocks; the bias repeats every `width`.
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret

# Globals read inside @triton.jit functions must be constexpr.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
TANH_COEFF = tl.constexpr(0.044715)


@triton.jit
def _tanh(z):
    """tanh through exp (tl.math has none); |z| >= 15 is +-1 in fp32, so clamp to keep exp finite."""
    z = tl.minimum(tl.maximum(z, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _load_biased(x_ptr, b_ptr, offs, m, width, HAS_BIAS: tl.constexpr):
    v = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(b_ptr + offs % width, mask=m, other=0.0).to(tl.float32)
    return v


@triton.jit
def bias_gelu_forward(x_ptr, b_ptr, y_ptr, n, width, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = _load_biased(x_ptr, b_ptr, offs, m, width, HAS_BIAS)
    if EXACT:
        y = 0.5 * v * (1.0 + tl.math.erf(v * INV_SQRT_2))
    else:
        y = 0.5 * v * (1.0 + _tanh(SQRT_2_OVER_PI * v * (1.0 + TANH_COEFF * v * v)))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def bias_gelu_backward(
    dy_ptr, x_ptr, b_ptr, dx_ptr, n, width, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = _load_biased(x_ptr, b_ptr, offs, m, width, HAS_BIAS)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if EXACT:
        grad = 0.5 * (1.0 + tl.math.erf(v * INV_SQRT_2)) + v * INV_SQRT_2PI * tl.exp(-0.5 * v * v)
    else:
        t = _tanh(SQRT_2_OVER_PI * v * (1.0 + TANH_COEFF * v * v))
        grad = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_COEFF * v * v)
    tl.store(dx_ptr + offs, (dy * grad).to(dx_ptr.dtype.element_ty), mask=m)
