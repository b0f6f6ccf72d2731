"""Building the optimizer GPT-NeoX's `optimizer` dict asks for, plus the optimizers PyTorch lacks.

`build_optimizer(neox_args, model)` returns a torch.optim.Optimizer for the training loop to hand to
deepspeed.initialize(optimizer=...). Build it over the parameters as they will train: on their device and in their
dtype (megatron.training.loop moves and casts the model first, as deepspeed.initialize would), because what `adam`
becomes depends on the device. optimizer.type (lower-cased in neox_args.optimizer_type):

* adam            `adam_implementation` picks (see "Which Adam" below): torch.optim.AdamW(fused=True), or DeepSpeed's
                  FusedAdam where DeepSpeed fuses its 16-bit wrapper only around that. `adam_w_mode: false` gives
                  Adam with L2 decay.
* cpu_adam        deepspeed.ops.adam.DeepSpeedCPUAdam (needed for ZeRO-Offload; JIT-built on first use).
* cpu_torch_adam  torch.optim.AdamW / Adam, not fused.
* sgd             torch.optim.SGD (momentum, dampening, nesterov from params).
* sm3, madgrad_wd, lion   the implementations below.
* OneBitAdam, ZeroOneAdam, OneBitLamb, Lamb   refused by validation (megatron.neox_arguments.validation).

optimizer.params may hold lr (already in neox_args.lr), the optimizer's own keys, and weight_decay (else
neox_args.weight_decay); any other key is an error naming it. Weight decay is applied only to the
parameters `get_param_groups` says should decay (with a weight-decay schedule, start_weight_decay /
end_weight_decay, the LR scheduler sets its value each step). With decoupled_lr the input-embedding and
output-layer weights get groups of their own. When the parameters carry muP base shapes (use_mup, megatron.mup) the
groups are split by muP's learning-rate and weight-decay factors (mup's MuAdam / MuSGD rules).

Which Adam (DeepSpeed 0.19.8, runtime/engine.py _do_optimizer_sanity_check and _configure_*_optimizer):

* Without ZeRO, in fp16, or in bf16 outside the pipeline engine, DeepSpeed wraps the optimizer in FP16_Optimizer
  (fp32 master weights as one flat tensor per group, the gradients flattened into one, one norm, one multi-tensor
  Adam step) only when it is DeepSpeed's FusedAdam; any other optimizer gets FP16_UnfusedOptimizer: an fp32 copy of
  every parameter and Python loops over the parameters for the gradient copies, the unscaling, the norm and the
  copy back, every step. There, on CUDA, `adam` is FusedAdam.
* Everywhere else the optimizer DeepSpeed steps sees the same tensors whichever it is: with ZeRO 1-3, and with
  bf16 in the pipeline engine (BF16_Optimizer), one flat fp32 partition per group; in fp32 without ZeRO, the
  parameters themselves. torch's fused AdamW is a fused multi-tensor kernel over them as FusedAdam is, needs no JIT
  build (nvcc and ninja on every node), supports amsgrad, and, in fp32 without ZeRO, is an optimizer
  megatron.checkpoint.resharding can refill (it takes torch's and this module's only). There, and on CPU, `adam` is
  torch.optim.AdamW(fused=True).
* amsgrad: FusedAdam has none, so torch's fused AdamW (hence the unfused 16-bit wrapper without ZeRO);
  bias_correction: false exists only in DeepSpeed's Adam, so FusedAdam on CUDA (an error on CPU).
* When FusedAdam cannot be built (no nvcc / ninja, a compiler error), the optimizer is torch's fused AdamW and one
  warning says why. FusedAdam is built with a TORCH_CUDA_ARCH_LIST DeepSpeed can parse
  (megatron.utils.deepspeed_ops). A build that fails on some ranks only would give the ranks different 16-bit wrappers;
  a build failure is normally the machine's, the same everywhere.

Measured (bench/optimizer_step.py, NVIDIA H200, torch 2.11, DeepSpeed 0.19.8, 2026-11-28; a 12 x 768 GPT at vocab
50304, seq 2048, micro-batch 8, bf16 without ZeRO, through the training engine): FusedAdam under FP16_Optimizer
79.0 ms a step (engine.step 26.9 ms), 14.7 GiB; torch's fused AdamW under FP16_UnfusedOptimizer 98.6 ms (41.4 ms),
16.8 GiB."""

import logging
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.ops.op_builder import FusedAdamBuilder
from torch import nn

from megatron.mup.parametrization import mup_param_groups
from megatron.optim.param_groups import deepspeed_moe_param_groups, get_param_groups
from megatron.optim.weight_decay import base_weight_decay
from megatron.utils.deepspeed_ops import arch_list_deepspeed_can_parse

_log = logging.getLogger(__name__)

ACCEPTED_PARAMS: Dict[str, Tuple[str, ...]] = {
    "adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction"),
    "cpu_adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction"),
    "cpu_torch_adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction"),
    "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
    "sm3": ("lr", "momentum", "beta", "eps", "weight_decay"),
    "madgrad_wd": ("lr", "momentum", "eps", "weight_decay"),
    "lion": ("lr", "betas", "weight_decay"),
}


# ---------------------------------------------------------------------------------------------------
# Optimizers not in PyTorch
# ---------------------------------------------------------------------------------------------------

class SM3(torch.optim.Optimizer):
    """SM3-II (Anil et al., 2019, "Memory-Efficient Adaptive Optimization"): Adagrad whose second-moment
    accumulator for a tensor of rank k >= 2 is kept as k vectors, one per dimension, instead of a full tensor.

    Per step, for gradient g: nu = min over the dimension accumulators (broadcast) + g^2 (or, with beta > 0,
    beta * min + (1 - beta) * g^2); each dimension accumulator becomes the max of nu over the other dims;
    update u = g / sqrt(nu + eps); with momentum m: buf = m * buf + (1 - m) * u; p -= lr * buf.
    Rank 0/1 tensors keep a full accumulator (plain Adagrad). weight_decay is decoupled: p -= lr * wd * p."""

    def __init__(self, params: Iterable, lr: float = 0.1, momentum: float = 0.0, beta: float = 0.0,
                 eps: float = 1e-30, weight_decay: float = 0.0) -> None:
        if lr < 0 or not 0.0 <= momentum < 1.0 or not 0.0 <= beta < 1.0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"SM3: invalid lr={lr}, momentum={momentum}, beta={beta}, eps={eps} or "
                             f"weight_decay={weight_decay} (need lr, eps, weight_decay >= 0; momentum, beta in [0, 1))")
        super().__init__(params, dict(lr=lr, momentum=momentum, beta=beta, eps=eps, weight_decay=weight_decay))

    @staticmethod
    def _accumulator_shapes(shape: torch.Size) -> List[Tuple[int, ...]]:
        if len(shape) <= 1:
            return [tuple(shape)]
        return [tuple(size if d == dim else 1 for d, size in enumerate(shape)) for dim in range(len(shape))]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, beta, eps, wd = (group[k] for k in ("lr", "momentum", "beta", "eps", "weight_decay"))
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SM3 here supports dense gradients only")
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["accumulators"] = [torch.zeros(s, dtype=torch.float32, device=p.device)
                                             for s in self._accumulator_shapes(p.shape)]
                    if momentum > 0:
                        state["momentum_buffer"] = torch.zeros_like(grad)
                state["step"] += 1
                accs: List[torch.Tensor] = state["accumulators"]
                nu = accs[0]
                for acc in accs[1:]:
                    nu = torch.minimum(nu, acc)
                nu = nu.expand_as(grad)
                nu = nu * beta + grad * grad * (1.0 - beta) if beta > 0 else nu + grad * grad
                if len(accs) == 1:
                    accs[0].copy_(nu)
                else:
                    for dim, acc in enumerate(accs):
                        others = [d for d in range(grad.dim()) if d != dim]
                        acc.copy_(torch.amax(nu, dim=others, keepdim=True))
                update = grad * torch.rsqrt(nu + eps) if eps > 0 else torch.where(nu > 0, grad / nu.sqrt(), 0.0)
                if momentum > 0:
                    buf = state["momentum_buffer"]
                    buf.mul_(momentum).add_(update, alpha=1.0 - momentum)
                    update = buf
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr)
        return loss


class MADGRAD(torch.optim.Optimizer):
    """MADGRAD (Defazio & Jelassi, 2021), momentumized dual averaging, with decoupled weight decay
    (GPT-NeoX's "madgrad_wd").

    Step k = 0, 1, ...: lam = lr * sqrt(k + 1); s += lam * g; nu += lam * g^2;
    z = x0 - s / (cbrt(nu) + eps); x = (1 - c) x + c z with c = 1 - momentum; then, decoupled,
    x -= lr * weight_decay * x_k (x_k the value before this step). x0 is the parameter at its first step."""

    def __init__(self, params: Iterable, lr: float = 1e-2, momentum: float = 0.9, weight_decay: float = 0.0,
                 eps: float = 1e-6) -> None:
        if lr <= 0 or not 0.0 <= momentum < 1.0 or weight_decay < 0 or eps < 0:
            raise ValueError(f"MADGRAD: invalid lr={lr}, momentum={momentum}, weight_decay={weight_decay} or "
                             f"eps={eps} (need lr > 0, momentum in [0, 1), weight_decay, eps >= 0)")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eps=eps))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, wd, eps = (group[k] for k in ("lr", "momentum", "weight_decay", "eps"))
            c = 1.0 - momentum
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MADGRAD here supports dense gradients only")
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["grad_sum"] = torch.zeros_like(grad)
                    state["grad_sq_sum"] = torch.zeros_like(grad)
                    state["x0"] = p.detach().float().clone()
                lam = lr * math.sqrt(state["step"] + 1)
                state["step"] += 1
                state["grad_sum"].add_(grad, alpha=lam)
                state["grad_sq_sum"].addcmul_(grad, grad, value=lam)
                z = state["x0"] - state["grad_sum"] / (state["grad_sq_sum"].pow(1.0 / 3.0) + eps)
                x_old = p.detach().float()
                x_new = x_old * (1.0 - c) + z * c
                if wd:
                    x_new = x_new - lr * wd * x_old
                p.copy_(x_new)
        return loss


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

    u = sign(beta1 * m + (1 - beta1) * g); p = p * (1 - lr * wd) - lr * u; m = beta2 * m + (1 - beta2) * g."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: Tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr <= 0 or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: invalid lr={lr}, betas={betas} or weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(grad)
                exp_avg = state["exp_avg"]
                update = (exp_avg * beta1 + grad * (1.0 - beta1)).sign_()
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss


# ---------------------------------------------------------------------------------------------------
# Building from the config
# ---------------------------------------------------------------------------------------------------

def _optimizer_params(neox_args: Any, kind: str) -> Dict[str, Any]:
    if neox_args.optimizer is None:
        raise ValueError("no optimizer configured: set e.g. optimizer: {type: Adam, params: {lr: 0.0006}}")
    params = dict(neox_args.optimizer.get("params") or {})
    accepted = ACCEPTED_PARAMS[kind]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"optimizer.params {unknown} are not accepted by optimizer type {kind!r}; "
                         f"accepted: {', '.join(accepted)}")
    if neox_args.lr is None:
        raise ValueError("no learning rate: set optimizer.params.lr (or lr)")
    params["lr"] = float(neox_args.lr)
    if "betas" in params:
        params["betas"] = tuple(float(b) for b in params["betas"])
    return params


def parameters_device_type(groups: List[Dict[str, Any]]) -> str:
    """The device type ("cpu", "cuda", ...) all the groups' parameters are on; "cpu" for no parameters."""
    devices = {p.device.type for g in groups for p in g["params"]}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several device types {sorted(devices)}; move the model to "
                         f"one device before building the optimizer")
    return devices.pop() if devices else "cpu"


TORCH_FUSED_ADAM = "torch.optim.AdamW(fused=True)"
DEEPSPEED_FUSED_ADAM = "deepspeed.ops.adam.FusedAdam"


def deepspeed_fuses_16bit_wrapper_only_for_fused_adam(neox_args: Any) -> bool:
    """Whether DeepSpeed 0.19 wraps the optimizer in its flat FP16_Optimizer only when it is FusedAdam (any other:
    FP16_UnfusedOptimizer): without ZeRO, in fp16, or in bf16 outside the pipeline engine (whose bf16 is
    BF16_Optimizer, flat whatever the optimizer). See the module docstring."""
    if neox_args.zero_stage != 0:
        return False
    return neox_args.precision == "fp16" or (neox_args.precision == "bfloat16" and not neox_args.is_pipe_parallel)


def adam_implementation(neox_args: Any, device_type: str) -> str:
    """TORCH_FUSED_ADAM or DEEPSPEED_FUSED_ADAM: what optimizer type `adam` becomes for parameters on
    ``device_type`` (``parameters_device_type``) under this config. The rule and its reasons: the module
    docstring ("Which Adam")."""
    if device_type != "cuda":
        return TORCH_FUSED_ADAM
    params = (neox_args.optimizer or {}).get("params") or {}
    if params.get("amsgrad"):
        return TORCH_FUSED_ADAM
    if params.get("bias_correction", True) is False or deepspeed_fuses_16bit_wrapper_only_for_fused_adam(neox_args):
        return DEEPSPEED_FUSED_ADAM
    return TORCH_FUSED_ADAM


def _load_fused_adam_op() -> None:
    """Build (or load the cached build of) DeepSpeed's FusedAdam CUDA op, with an arch list it can parse."""
    with arch_list_deepspeed_can_parse():
        FusedAdamBuilder().load()


def _deepspeed_fused_adam(groups: List[Dict[str, Any]], params: Dict[str, Any]) -> torch.optim.Optimizer:
    """DeepSpeed's FusedAdam; torch's fused AdamW, with one warning saying why, where its op cannot be built."""
    try:
        _load_fused_adam_op()  # FusedAdam's own load() below then finds it built
    except Exception as err:  # the JIT build raises whatever its compiler, ninja or nvcc lookup raises
        reason = f"{type(err).__name__}: {next(iter(str(err).strip().splitlines()), '')}"
        _log.warning("DeepSpeed's FusedAdam could not be built (%s); using %s instead (without ZeRO, 16-bit "
                     "training then gets DeepSpeed's slower FP16_UnfusedOptimizer)", reason, TORCH_FUSED_ADAM)
        return _torch_adam(groups, params, fused=True)

    return FusedAdam(groups, **params)


def _torch_adam(groups: List[Dict[str, Any]], params: Dict[str, Any], fused: bool) -> torch.optim.Optimizer:
    params = dict(params)
    if not params.pop("bias_correction", True):
        raise ValueError("optimizer.params.bias_correction: false is only supported by DeepSpeed's Adam "
                         "(adam on CUDA, or cpu_adam); torch's Adam always corrects the bias")
    adam_w_mode = params.pop("adam_w_mode", True)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(groups, fused=fused, **params)


def _mup_groups(groups: List[Dict[str, Any]], kind: str, lr: float) -> List[Dict[str, Any]]:
    """With muP base shapes on the parameters, the groups split by muP's factors (megatron.mup.parametrization),
    each starting at lr x lr_mult (the LR schedule keeps that factor every step)."""
    groups = mup_param_groups(groups, kind)
    for group in groups:
        if "lr_mult" in group:
            group["lr"] = lr * group["lr_mult"]
    return groups


def build_optimizer(neox_args: Any, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer named by neox_args.optimizer_type over `get_param_groups(model, ...)`.

    Build it after the model is on its device and in its training dtype (what `adam` becomes depends on the
    device: `adam_implementation`) and pass it to deepspeed.initialize(optimizer=...). With ZeRO-Offload, DeepSpeed
    requires optimizer type CPU_Adam."""
    kind = neox_args.optimizer_type
    if kind not in ACCEPTED_PARAMS:  # OneBitAdam & co. are refused by validation (COMPRESSED_OPTIMIZERS)
        raise ValueError(f"optimizer type {kind!r} is not one of {', '.join(ACCEPTED_PARAMS)}")
    params = _optimizer_params(neox_args, kind)
    params.pop("weight_decay", None)
    weight_decay = base_weight_decay(neox_args)
    schedule = [v for v in (neox_args.start_weight_decay, neox_args.end_weight_decay) if v is not None]
    if schedule or neox_args.weight_decay_incr_style != "constant":
        # the groups that decay are chosen as for a non-zero decay; the LR scheduler sets their value each step
        weight_decay = max(schedule + [weight_decay])
    decoupled = neox_args.decoupled_lr is not None
    moe_group = bool(getattr(neox_args, "create_moe_param_group", False) and getattr(neox_args, "moe_num_experts", 1) > 1)
    experts_marked = getattr(neox_args, "moe_type", None) == "deepspeed" or \
        getattr(neox_args, "moe_expert_parallel_size", 1) > 1  # DeepSpeed's expert marks (allreduce=False)
    if moe_group and experts_marked:
        groups = deepspeed_moe_param_groups(model, weight_decay, decoupled_lr=decoupled)
    else:
        groups = get_param_groups(model, weight_decay, moe_param_group=moe_group, decoupled_lr=decoupled)
    if not groups:
        raise ValueError("the model has no trainable parameters to optimize")
    groups = _mup_groups(groups, kind, params["lr"])
    if kind == "adam":
        if adam_implementation(neox_args, parameters_device_type(groups)) == DEEPSPEED_FUSED_ADAM:
            return _deepspeed_fused_adam(groups, params)
        return _torch_adam(groups, params, fused=True)
    if kind == "cpu_torch_adam":
        return _torch_adam(groups, params, fused=False)
    if kind == "cpu_adam":
        if "adam_w_mode" in params:
            params["adamw_mode"] = params.pop("adam_w_mode")
        return DeepSpeedCPUAdam(groups, **params)
    if kind == "sgd":
        return torch.optim.SGD(groups, **params)
    if kind == "sm3":
        return SM3(groups, **params)
    if kind == "madgrad_wd":
        return MADGRAD(groups, **params)
    return Lion(groups, **params)


def describe_param_groups(groups: List[Dict[str, Any]]) -> List[str]:
    """What distinguishes each optimizer group, in order (its name, whether it decays, DeepSpeed's expert mark)."""
    return [f"{group.get('name') or ('decay' if group.get('weight_decay') else 'no_decay')}"
            f"{' (experts)' if group.get('moe') else ''}" for group in groups]


def pipeline_group_mismatch(stage_groups: List[List[str]]) -> Optional[str]:
    """Why ZeRO 1 / 2 would hang in this pipeline, or None. DeepSpeed's ZeRO 1 / 2 computes the gradient norm one
    parameter group at a time, each with an all-reduce over the model-parallel ranks, pipeline stages included: stages
    with different numbers of groups wait on each other for ever (e.g. a mixture of experts whose experts' group exists
    only on the stages that hold an MoE layer)."""
    if all(len(groups) == len(stage_groups[0]) for groups in stage_groups):
        return None
    listed = "; ".join(f"stage {stage}: {', '.join(groups) or 'none'}" for stage, groups in enumerate(stage_groups))
    return (f"the pipeline stages have different optimizer parameter groups ({listed}), and DeepSpeed's ZeRO stage "
            f"1 / 2 reduces the gradient norm group by group over all stages, so the run would hang at its first "
            f"step. Give every stage the same groups: with a mixture of experts set create_moe_param_group: false, "
            f"or put an MoE layer on every stage (moe_expert_interval / num_layers / pipe_partition_method); or use "
            f"zero_optimization.stage 0")
