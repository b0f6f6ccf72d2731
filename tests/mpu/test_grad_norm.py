"""megatron.mpu.grad_norm on one process: the whole gradient's norm and DeepSpeed's clipping rule, expert
parameters (DeepSpeed's allreduce=False mark) included (their sum over expert-parallel ranks: the expert-parallel
test in tests/model/test_moe_expert_parallel.py)."""
import torch

from megatron.mpu import SingleProcessState
from megatron.mpu.grad_norm import clip_grad_norm, global_grad_norm, is_expert_parameter


def _params():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 2
    params[1].allreduce = False  # DeepSpeed's mark of an expert
    params[2].allreduce = True
    return params


def test_norm_and_clipping_match_torch():
    params, reference = _params(), _params()
    assert [is_expert_parameter(p) for p in params] == [False, True, False]
    want = torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0)
    norm = clip_grad_norm(params, 1.0, SingleProcessState())
    torch.testing.assert_close(norm, want.reshape(1))
    assert norm > 1.0  # so the gradients were scaled
    for p, q in zip(params, reference):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(global_grad_norm(params, SingleProcessState()), torch.ones(1), rtol=1e-5, atol=0)


def test_bf16_gradients_are_summed_in_fp32_and_the_norm_stays_a_tensor():
    """Each gradient's squares in fp32 (as the per-parameter .float() of before), the result a one-element fp32
    tensor on the gradients' device that nothing has read back (the caller reads it when it logs it)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16)) for _ in range(3)]
    for p in params:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 3).to(torch.bfloat16)
    norm = global_grad_norm(params, SingleProcessState())
    want = torch.cat([p.grad.float().reshape(-1) for p in params]).pow(2).sum().sqrt()
    print(f"norm {norm.item():.8f} want {want.item():.8f}")
    assert norm.shape == (1,) and norm.dtype == torch.float32 and norm.device == params[0].grad.device
    torch.testing.assert_close(norm, want.reshape(1), rtol=1e-6, atol=0)
    assert global_grad_norm([torch.nn.Parameter(torch.ones(2))], SingleProcessState()).tolist() == [0.0]
