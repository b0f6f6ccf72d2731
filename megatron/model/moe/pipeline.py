"""DeepSpeed's MoE experts (DeepSpeed's layer, the expert-parallel dropless layer) under DeepSpeed's PipelineEngine.

DeepSpeed 0.19 (pinned >=0.19.8,<0.20) trains them in a pipeline as it does without one: each stage's engine
reduces its experts' gradients over the expert-data-parallel group and the rest over the data-parallel group, and
saves each expert in a file of its own, ``layer_{i}_expert_{e}_mp_rank_{m:02d}_model_states.pt``, where i counts
the MoE layers of that stage's module and m is the pipeline engine's model-parallel rank (stage x T + tensor rank):
the files of the stages and of their tensor-parallel ranks (each with its replicated or, with
enable_expert_tensor_parallelism, split experts; the dropless layer's block) are distinct, and every key inside names
the global pipeline layer (``{slot}.mlp....``); DeepSpeed's engine loads them by the same m.
megatron.checkpoint_conversion reads them back by stage and tensor-parallel rank (expert_slot_states). Two gaps of
its pipeline engine with MoE are closed here, per engine (no global patch):

* loading: a stage with MoE layers loads its module from its ``mp_rank`` file and skips the pipeline module's
  tied-weight broadcast, which the stages without MoE layers do run: the stages would wait on each other for
  ever. After its load the MoE stage runs the same broadcast (``_synchronize_tied_weights``).
* saving: a stage with MoE layers writes its weights into its ``mp_rank`` file only, not into GPT-NeoX's
  ``layer_{slot:02d}-model_{t:02d}-model_states.pt`` files, which megatron.checkpoint_conversion (inference,
  export, resharding) reads in a pipeline. They are written too here, without the experts (in their own files).

And with expert parallelism without ZeRO, DeepSpeed's clipping norm averages the data-parallel ranks' norms, which
hold other experts: every stage clips by megatron.mpu.grad_norm's norm of the whole gradient instead (as without a
pipeline, megatron.training.loop), summed over the stages. (ZeRO 1 computes a whole norm itself.)
"""
from __future__ import annotations

import os

from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron.mpu.grad_norm import clip_grad_norm

EXPERT_MARK = ".deepspeed_moe.experts."
"""What every expert parameter's name holds (DeepSpeed's layer and the expert-parallel dropless layer)."""


def adapt_pipeline_moe_engine(engine, parallel_state) -> bool:
    """Close the gaps (module docstring) on ``engine``, a pipeline engine of a model with DeepSpeed MoE layers (on
    some stage): the clipping norm on every stage, loading and saving on the stages with MoE layers; returns whether
    this stage has them."""
    if not isinstance(engine, PipelineEngine):
        return False
    if parallel_state.get_expert_parallel_world_size() > 1:  # every stage: the norm sums over all of them
        stages = engine.mpu.get_model_parallel_group()

        def clip_and_record() -> None:
            engine._global_grad_norm = clip_grad_norm(engine.module.parameters(), engine.gradient_clipping(),
                                                      parallel_state, pipeline_group=stages)

        engine.clip_fp32_gradients = clip_and_record
    if not engine.has_moe_layers:
        return False
    load_module = engine.load_module_state_dict
    save_moe = engine._save_moe_checkpoint

    def load_module_state_dict(*args, **kwargs):
        load_module(*args, **kwargs)
        engine.module._synchronize_tied_weights()

    def save_moe_checkpoint(save_dir, tag, *args, **kwargs):
        save_moe(save_dir, tag, *args, **kwargs)
        write_layer_files(engine, os.path.join(save_dir, str(tag)))

    engine.load_module_state_dict = load_module_state_dict
    engine._save_moe_checkpoint = save_moe_checkpoint
    return True


def write_layer_files(engine, path: str) -> None:
    """This stage's GPT-NeoX layer files without the experts, by data-parallel rank 0 (as DeepSpeed's pipeline
    module writes them)."""
    module = engine.module
    if module._grid.data_parallel_id != 0:
        return
    for index, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "state_dict"):
            continue
        state = {name: tensor.detach().clone() for name, tensor in layer.state_dict().items()
                 if EXPERT_MARK not in f".{name}"}
        engine.checkpoint_engine.save(state, module.ckpt_layer_path(path, index))


def expert_slot_states(expert_files: dict, tp: int) -> dict:
    """{(slot, tensor-parallel rank): slot-relative expert tensors} of a pipeline checkpoint's expert files
    (``expert_files``: {file name's model-parallel rank m: merged state of its files}; keys ``{slot}.{name}``,
    the tensor-parallel rank is m mod T)."""
    out: dict = {}
    for mp_rank, state in expert_files.items():
        for key, value in state.items():
            slot, name = key.split(".", 1)
            out.setdefault((int(slot), mp_rank % tp), {})[name] = value
    return out


__all__ = ["adapt_pipeline_moe_engine", "expert_slot_states", "write_layer_files"]
