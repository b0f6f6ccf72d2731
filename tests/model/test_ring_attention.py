"""Ring attention's steps (megatron.model.ring_attention) on one device, its ranks played in turn by
megatron.model.ring_simulation: every kernel gives attention over the whole sequence (output and gradients), no
step of the fused or tiled kernels allocates anything near an [S/C, S/C] score block in its forward or backward
pass (the flash and memory-efficient CUDA kernels checked on the meta device, where they run as shapes), and the
choice of kernel. The process-group ring is tested on gloo ranks in tests/model/test_context_parallel.py."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.model import ring_attention as ring
from megatron.model.ring_attention import choose_kernel, ring_attention_on
from megatron.model.ring_simulation import SimulatedRing, simulate_ring_attention


def _whole(q, k, v, grad_out):
    """Causal SDPA over the whole sequence: (output, dq, dk, dv)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=k.size(1) < q.size(1))
    out.backward(grad_out)
    return (out.detach(), *(t.grad for t in leaves))


def _inputs(seq: int, kv_heads: int, dtype=torch.float32, device="cpu", heads: int = 4, head_dim: int = 8):
    gen = torch.Generator().manual_seed(seq + kv_heads)
    q, grad = (torch.randn(1, heads, seq, head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, seq, head_dim, generator=gen) for _ in range(2))
    return [t.to(device, dtype) for t in (q, k, v, grad)]


@pytest.mark.parametrize("cp_size,kv_heads", [(2, 4), (2, 2), (4, 2)])
def test_every_kernel_gives_whole_sequence_attention(cp_size, kv_heads, monkeypatch):
    monkeypatch.setattr(ring, "EXPLICIT_QUERY_ROWS", 6)  # several tiles per step at this size
    q, k, v, grad = _inputs(48, kv_heads)
    want = _whole(q, k, v, grad)
    for kernel in ("cpu_flash", "explicit", "scores"):
        got = simulate_ring_attention(q, k, v, cp_size, grad, kernel)
        errors = {name: (a - b).abs().max().item() for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
        print(f"CP={cp_size} kv_heads={kv_heads} {kernel}: max error vs whole-sequence SDPA "
              + ", ".join(f"{name} {e:.1e}" for name, e in errors.items()))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{kernel} {name}")


class _LargestTensor(TorchDispatchMode):
    """The largest storage (in elements) any op returns while active, and which op returned it."""

    def __init__(self):
        super().__init__()
        self.elements, self.where = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor):
                elements = t.untyped_storage().nbytes() // t.element_size()
                if elements > self.elements:
                    self.elements, self.where = elements, f"{func} -> {tuple(t.shape)}"
        return result


@pytest.mark.parametrize("kernel,device,dtype", [("cpu_flash", "cpu", torch.float32),
                                                 ("explicit", "cpu", torch.float32),
                                                 ("flash", "meta", torch.bfloat16),
                                                 ("efficient", "meta", torch.bfloat16),
                                                 ("scores", "cpu", torch.float32)])
def test_no_ring_step_allocates_a_score_block(kernel, device, dtype):
    """Forward and backward of both ranks of a CP=2 ring at S/C = 1024 positions, 2 heads: the score block of step
    0 is 2 x 1024 x 1024 elements; nothing any op returns may reach a quarter of it (q of a rank is 2 x 1024 x 16,
    the kv stack twice that). ``scores``, the per-step computation before the fused kernels (the only one any
    device but the CPU had), must be caught."""
    heads, local = 2, 1024
    q, k, v, grad = _inputs(2 * local, heads, dtype, device, heads=heads, head_dim=16)
    with _LargestTensor() as largest:
        simulate_ring_attention(q, k, v, 2, grad, kernel)
    block = heads * local * local
    print(f"{kernel}: largest tensor {largest.elements:,} elements ({largest.where}); score block {block:,}")
    if kernel == "scores":
        assert largest.elements >= block, largest.where
    else:
        assert largest.elements < block // 4, largest.where


def test_kernel_choice_and_refusal():
    q = torch.zeros(1, 2, 8, 16)
    assert choose_kernel(q) == "cpu_flash"
    assert choose_kernel(q.to("meta")) == "explicit"  # a device without a fused kernel here
    ring_of_one = SimulatedRing(0, [torch.zeros(2, 1, 2, 8, 16)], [torch.zeros(2, 1, 2, 8, 16)])
    with pytest.raises(ValueError, match="kernel 'flashy' is not one of flash, efficient"):
        ring_attention_on(ring_of_one, q, q, q, kernel="flashy")
    with pytest.raises(ValueError, match="two equal chunks; got 7 positions"):
        ring_attention_on(ring_of_one, q[:, :, :7], q[:, :, :7], q[:, :, :7])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "flash"), (torch.float16, "flash"),
                                          (torch.float32, "efficient")])
def test_cuda_kernels_give_whole_sequence_attention(dtype, kernel):
    """On a GPU: the fused kernel chosen for this dtype, ring of 2 and of 4, against fp32 attention over the whole
    sequence, no worse than twice SDPA's own error in that dtype (plus 1e-3); the explicit kernel agrees too."""
    q, k, v, grad = _inputs(1024, 2, torch.float32, "cuda", heads=4, head_dim=64)
    want = _whole(q, k, v, grad)
    low = [t.to(dtype) for t in (q, k, v, grad)]
    sdpa = [(a.float() - b).abs().max().item() for a, b in zip(_whole(*low), want)]
    assert choose_kernel(low[0]) == kernel
    for cp_size, kind in ((2, None), (4, None), (2, "explicit")):
        got = simulate_ring_attention(*low[:3], cp_size, low[3], kind)
        errors = [(a.float() - b).abs().max().item() for a, b in zip(got, want)]
        print(f"{dtype} CP={cp_size} {kind or kernel}: max error out/dq/dk/dv {errors}; SDPA {sdpa}")
        assert all(e <= 2 * s + 1e-3 for e, s in zip(errors, sdpa)), (errors, sdpa)
