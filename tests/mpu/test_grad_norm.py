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
