"""Setting a run up for training: the model, its optimizer and LR schedule handed to deepspeed.initialize, with the
model placed (device, dtype, data / context partitions) as DeepSpeed will want it and the gradient-norm bookkeeping
the engine and the logs share."""
import os
from typing import Any, Dict

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import clip_grad_norm_

from megatron.checkpoint.files import use_safe_loading
from megatron.errors import ConfigError
from megatron.initialize import RunContext
from megatron.model.gpt2_model import build_model, loss_function
from megatron.model.moe.pipeline import adapt_pipeline_moe_engine
from megatron.model.random_ltd import apply_random_ltd
from megatron.mpu.grad_norm import clip_grad_norm
from megatron.mpu.host_collectives import all_gather_object
from megatron.optim.learning_rates import build_lr_scheduler
from megatron.optim.optimizers import build_optimizer, describe_param_groups, pipeline_group_mismatch
from megatron.post_training.objectives import preference_loss
from megatron.training.mup_run import prepare_model
from megatron.training_schedule import TrainingSchedule
from megatron.utils.lazy_compile import DEEPSPEED_MUON, import_with_lazy_compile


def _mark_grad_norm_ownership(model: torch.nn.Module, parallel_state) -> None:
    """Make DeepSpeed's gradient norm (clipping, ZeRO) count every parameter exactly once.

    DeepSpeed counts a parameter when it is marked `model_parallel` or when the rank is model-parallel
    rank 0 of its mpu. Under the pipeline engine that mpu spans all stages, so without marks the later
    stages' parameters would be left out (and the norm, hence clipping, would differ from the same model
    without a pipeline). Mark tensor-parallel shards on every rank, and replicated parameters on
    tensor-parallel rank 0 only, and neither on the tied copies DeepSpeed already counts on another stage (a
    tensor-parallel tied embedding too: counted on both stages it doubled its share of the norm)."""
    tp_rank0 = parallel_state.get_model_parallel_rank() == 0
    for param in model.parameters():
        split = getattr(param, "model_parallel", False) and parallel_state.get_model_parallel_world_size() > 1
        replicated_elsewhere = getattr(param, "ds_pipe_replicated", False)
        param.model_parallel = bool((split or tp_rank0) and not replicated_elsewhere)


def _record_clipping_grad_norm(engine) -> None:
    """Without ZeRO, DeepSpeed computes the global norm to clip but throws it away; keep it so that it can be
    logged without computing it a second time. With expert parallelism DeepSpeed's norm is not the whole
    gradient's (megatron.mpu.grad_norm): clip by that one instead."""
    experts_split = getattr(engine.mpu, "expert_parallel_size", 1) > 1

    def clip_and_record() -> None:
        if experts_split:
            engine._global_grad_norm = clip_grad_norm(engine.module.parameters(), engine.gradient_clipping(),
                                                      engine.mpu)
            return
        engine._global_grad_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                    max_norm=engine.gradient_clipping(), mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_and_record


def setup_model_and_optimizer(neox_args, ctx: RunContext, schedule: TrainingSchedule):
    """Build the model, optimizer and LR schedule and hand them to deepspeed.initialize.

    The schedule is the built-in AnnealingLR, or, when the config has a DeepSpeed `scheduler` dict, the
    scheduler DeepSpeed builds from it (the engine steps either after each optimizer step and saves and loads
    its state in checkpoints)."""
    model = build_model(ctx.model_config, ctx.parallel_state, ctx.rng_tracker)
    if neox_args.use_mup:  # base shapes on the parameters and muP's initialisation; then muP's optimizer groups

        prepare_model(neox_args, model, ctx.parallel_state)
    loss_fn = preference_loss(neox_args, ctx.parallel_state.get_model_parallel_group())
    if loss_fn is not None:  # DPO / KTO: the model's own loss (the LM loss, or a reward model's) is replaced
        model.loss_fn = loss_fn
    place_as_deepspeed_will(model, neox_args, ctx)
    optimizer = build_optimizer(neox_args, model)
    if neox_args.is_pipe_parallel and neox_args.zero_stage in (1, 2):
        _check_stage_param_groups(optimizer, ctx.parallel_state)
    lr_scheduler = None if neox_args.scheduler else build_lr_scheduler(neox_args, schedule, optimizer)
    config = {k: v for k, v in neox_args.deepspeed_config.items() if k != "optimizer"
              and not (k == "scheduler" and lr_scheduler is not None)}
    if neox_args.is_pipe_parallel and neox_args.context_parallel_size > 1:
        # the pipeline engine's data axis is data x context (ParallelState.get_topology): it counts each
        # context-parallel rank's chunks of the same samples as a batch of their own
        config["train_batch_size"] = neox_args.train_batch_size * neox_args.context_parallel_size
    if neox_args.zero_stage > 0 and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        # ZeRO refuses optimizers DeepSpeed has not tested unless told; ours are tested here
        config.setdefault("zero_allow_untested_optimizer", True)
    if neox_args.is_pipe_parallel:
        _mark_grad_norm_ownership(model, ctx.parallel_state)
    if neox_args.zero_stage == 3 and neox_args.context_parallel_size > 1:
        _partition_over_data_and_context(model, ctx, config)
    if neox_args.zero_stage > 0:  # ZeRO's optimizer check imports DeepSpeed's Muon: its torch.compile, deferred
        import_with_lazy_compile(DEEPSPEED_MUON)
    engine, _, _, engine_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config,
        mpu=None if neox_args.is_pipe_parallel else ctx.parallel_state, dist_init_required=False)
    if neox_args.is_pipe_parallel and neox_args.context_parallel_size > 1:
        # its batch check passed at construction: from here on (samples counted, DeepSpeed's monitors and
        # samples/sec) the batch is the real one again
        engine._config.train_batch_size = neox_args.train_batch_size
    _record_clipping_grad_norm(engine)
    if neox_args.is_pipe_parallel and neox_args.moe_num_experts > 1:
        adapt_pipeline_moe_engine(engine, ctx.parallel_state)
    use_safe_loading(engine)
    skip_single_rank_allreduce(engine, neox_args, ctx.parallel_state)
    if engine.random_ltd_enabled():  # data_efficiency's random-LTD: DeepSpeed's scheduler, on our layers
        apply_random_ltd(model, engine.random_ltd_config(), engine.random_ltd_scheduler)
    return engine, optimizer, lr_scheduler if lr_scheduler is not None else engine_scheduler


TRAINING_DTYPES = {"fp16": torch.float16, "bfloat16": torch.bfloat16}
"""neox_args.precision -> the dtype DeepSpeed casts the parameters to (fp32: none)."""


CASTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The parameter dtypes DeepSpeed 0.19 casts to the training dtype (runtime/engine.py CASTABLE_DTYPES)."""


def place_as_deepspeed_will(model: torch.nn.Module, neox_args, ctx: RunContext) -> None:
    """Cast the parameters to the 16-bit training dtype and move the model to ctx.device, as deepspeed.initialize
    does (engine._configure_distributed_model: the floating-point parameters cast, the buffers left as they are,
    then module.to(device)), but before the optimizer is built: megatron.optim.optimizers chooses and builds it for the
    parameters as they will train (DeepSpeed's FusedAdam on CUDA where that gives the flat 16-bit optimizer). The
    parameter objects stay the same (their data is replaced), as under DeepSpeed's own cast, so the attributes set on
    them (muP shapes, expert and no-decay flags) stay, and DeepSpeed's cast and move then find nothing to do.

    Under ZeRO-3 with context parallelism the model is cast but stays on the host: deepspeed.zero.Init
    (_partition_over_data_and_context) moves it to the device one parameter's partition at a time, so the whole
    model never has to fit on one device. DeepSpeed's accelerator must be the device the project trains on, or
    the engine would move the model to the other one: a RuntimeError says so before anything is built."""
    accelerator = get_accelerator().device_name()
    if accelerator != ctx.device.type:
        raise RuntimeError(
            f"DeepSpeed's accelerator is {accelerator!r} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')!r}) but "
            f"this worker trains on {ctx.device}: unset DS_ACCELERATOR to let DeepSpeed use the GPU, or hide the "
            f"GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU")
    dtype = TRAINING_DTYPES.get(neox_args.precision)
    if dtype is not None:
        for param in model.parameters():
            if param.dtype in CASTABLE_DTYPES and param.dtype != dtype:
                param.data = param.data.to(dtype)
    if not (neox_args.zero_stage == 3 and neox_args.context_parallel_size > 1):
        model.to(ctx.device)


def _check_stage_param_groups(optimizer: torch.optim.Optimizer, ps) -> None:
    """Every pipeline stage must have the same optimizer groups under ZeRO 1 / 2 (megatron.optim.optimizers.
    pipeline_group_mismatch): a ConfigError on every rank instead of a hang at the first step."""
    stages = all_gather_object(describe_param_groups(optimizer.param_groups), group=ps.get_pipe_parallel_group())
    problem = pipeline_group_mismatch(stages)
    if problem:
        raise ConfigError([problem])


def _partition_over_data_and_context(model: torch.nn.Module, ctx: RunContext, config: Dict[str, Any]) -> None:
    """ZeRO-3 with context parallelism. DeepSpeed's engine would partition the parameters over its mpu's
    data-parallel group alone, so the context-parallel ranks' gradients would never be summed: partition them over
    data x context here (deepspeed.zero.Init on the built module; the engine then keeps that partitioning). Stage
    3's reduce-scatter averages over that whole group, so the loss's gradient share is scaled by
    context_parallel_size, as under the pipeline engine (megatron.model.gpt2_model.cross_entropy_loss)."""
    ps = ctx.parallel_state
    deepspeed.zero.Init(module=model, data_parallel_group=ps.get_sequence_data_parallel_group(),
                        config_dict_or_path=config, mpu=ps)
    model.loss_fn = loss_function(ctx.model_config, ps, averaged_over_context=True)


def skip_single_rank_allreduce(engine, neox_args, parallel_state) -> bool:
    """Without ZeRO or a pipeline, DeepSpeed all-reduces the gradients after every backward through one
    flat buffer: every gradient copied in and back out, even over a single data-parallel rank, where the
    average is the gradient itself (137 ms a step for a 160M model on CPU). Switch that off there; ZeRO
    (whose optimizer keeps its own gradient state in that call) and the pipeline engine are left as they
    are. Returns whether it was switched off."""
    if neox_args.zero_stage != 0 or neox_args.is_pipe_parallel or \
            parallel_state.get_sequence_data_parallel_world_size() != 1:  # data x context-parallel ranks
        return False
    engine.enable_backward_allreduce = False
    return True
