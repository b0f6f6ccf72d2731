"""The `data_efficiency.data_routing.random_ltd` section: random layerwise token dropping (Yao et al., "Random-LTD",
arXiv 2211.11586) as DeepSpeed's Data Efficiency library schedules it, on this model's transformer layers, and the
rules of its keys. The layers themselves are megatron.model.random_ltd's (this module does not import torch, as
megatron.model.config does not).

    random_ltd:
      enabled: true
      total_layer_num: 4                  # num_layers
      random_ltd_layer_num: 2
      random_ltd_layer_id: [1, 2]         # transformer layers, 0-based (GPT-NeoX's layer i sits in slot i + 2)
      random_ltd_schedule: {min_value: 16, max_value: 32, schedule_type: fixed_linear,
                            schedule_config: {require_steps: 8, seq_per_step: 8}}

At training step k (DeepSpeed's global_steps, 0 at the first step) each listed layer runs on
min(max_value, min_value + floor(k / require_steps x (max_value - min_value)), rounded down to a multiple of
seq_per_step) tokens of every sample, drawn at random once per step and kept in order, and passes the others
through unchanged (DeepSpeed's RandomLTDScheduler decides the length; the same draw serves every listed layer).

What the layers can be: attention layers that see the whole causal past (global / flash), in a model whose positions
are added at the embedding (pos_emb learned, sinusoidal or none) or are rotary (each kept token is rotated by its
place in the whole sequence, megatron.model.random_ltd). An ALiBi / relative-position layer would attend the kept
tokens at their places in the shortened sequence, not at their real positions, and a sliding-window, sparse or
recurrent layer's notion of "nearby" would change the same way.
"""
from typing import Any, Dict, List, Mapping, Optional

KEYS = ("enabled", "total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name",
        "model_type", "hidden_state_order", "random_ltd_schedule", "layer_token_lr_schedule")
SCHEDULE_KEYS = ("min_value", "max_value", "schedule_type", "schedule_config")
FIXED = {"model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim"}
"""Keys whose value is this model's (DeepSpeed's wrapper reads them): filled in when absent, refused otherwise."""
DROPPABLE_TYPES = ("global", "flash")
KEPT_POSITIONS = ("learned", "sinusoidal", "none", "rotary")
"""pos_emb values under which a kept token is attended at its real position."""
WHERE = "data_efficiency.data_routing.random_ltd"


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def random_ltd_problems(section: Optional[Mapping[str, Any]], config, train_impl: str) -> List[str]:
    """What is wrong with an enabled random_ltd section for the model ``config`` (a ModelConfig), each naming the
    key; [] when the section is None (off)."""
    if section is None:
        return []
    problems = [f"{WHERE}.{key}: unknown key; the keys are {', '.join(KEYS)}" for key in section if key not in KEYS]
    layers = config.num_layers
    total = section.get("total_layer_num")
    if total != layers:
        problems.append(f"{WHERE}.total_layer_num={total!r} must be the model's num_layers={layers} (DeepSpeed "
                        f"counts the layer tokens of the whole model with it)")
    ids = section.get("random_ltd_layer_id")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.append(f"{WHERE}.random_ltd_layer_id={ids!r} must be a non-empty list of transformer layer indices "
                        f"(0-based, below num_layers={layers})")
        ids = []
    else:
        outside = [i for i in ids if not 0 <= i < layers]
        if outside:
            problems.append(f"{WHERE}.random_ltd_layer_id: {outside} out of range; the model's transformer layers "
                            f"are 0 .. {layers - 1} (num_layers={layers})")
        if len(set(ids)) != len(ids):
            problems.append(f"{WHERE}.random_ltd_layer_id={ids} lists a layer more than once")
        wrong = sorted({f"{i} ({config.attention_types[i]})" for i in ids if 0 <= i < len(config.attention_types)
                        and config.attention_types[i] not in DROPPABLE_TYPES})
        if wrong:
            problems.append(f"{WHERE}.random_ltd_layer_id: layers {', '.join(wrong)} are not full causal attention "
                            f"layers; tokens can be dropped in {' / '.join(DROPPABLE_TYPES)} layers only")
    count = section.get("random_ltd_layer_num")
    if count != len(ids) and ids:
        problems.append(f"{WHERE}.random_ltd_layer_num={count!r} must be the length of random_ltd_layer_id "
                        f"({len(ids)})")
    for key, ours in FIXED.items():
        if section.get(key, ours) != ours:
            problems.append(f"{WHERE}.{key}={section[key]!r}: this model's is {ours!r} (set it so or delete the key)")
    if isinstance(section.get("layer_token_lr_schedule"), Mapping) and \
            section["layer_token_lr_schedule"].get("enabled"):
        problems.append(f"{WHERE}.layer_token_lr_schedule.enabled: DeepSpeed 0.19 does not implement the layer-token "
                        f"learning-rate schedule (it raises NotImplementedError); delete it")
    problems += _schedule_problems(section.get("random_ltd_schedule"), config.seq_length)
    if config.pos_emb not in KEPT_POSITIONS:
        problems.append(f"{WHERE} with pos_emb={config.pos_emb!r}: dropping tokens inside the layers needs positions "
                        f"added at the embedding or rotary ({', '.join(KEPT_POSITIONS)}); a {config.pos_emb} layer "
                        f"would attend the kept tokens at their places in the shortened sequence, not at their "
                        f"positions")
    if config.pipe_parallel_size > 1:
        problems.append(f"{WHERE} with pipe_parallel_size={config.pipe_parallel_size}: the tokens are drawn once per "
                        f"step in the first dropping layer and shared with the others on the same rank; use "
                        f"pipe_parallel_size <= 1")
    if config.sequence_parallel and config.model_parallel_size > 1:
        problems.append(f"{WHERE} with sequence_parallel: each tensor-parallel rank holds a part of the sequence, so "
                        f"a draw over the whole sequence cannot be gathered; turn sequence_parallel off")
    if config.context_parallel_size > 1:
        problems.append(f"{WHERE} with context_parallel_size={config.context_parallel_size}: each rank holds part "
                        f"of every sequence; use context_parallel_size 1")
    if train_impl != "normal":
        problems.append(f"{WHERE} with train_impl={train_impl!r}: token dropping is for language-model pretraining "
                        f"(train_impl 'normal')")
    return problems


def _schedule_problems(schedule: Any, seq_length: int) -> List[str]:
    where = f"{WHERE}.random_ltd_schedule"
    if not isinstance(schedule, Mapping):
        return [f"{where} must be a dict of {', '.join(SCHEDULE_KEYS)}"]
    problems = [f"{where}.{key}: unknown key; the keys are {', '.join(SCHEDULE_KEYS)}" for key in schedule
                if key not in SCHEDULE_KEYS]
    low, high = schedule.get("min_value"), schedule.get("max_value")
    for key, value in (("min_value", low), ("max_value", high)):
        if not _positive_int(value):
            problems.append(f"{where}.{key}={value!r} must be a positive integer (tokens per sample)")
    if _positive_int(low) and _positive_int(high):
        if low > high:
            problems.append(f"{where}.min_value={low} must be <= max_value={high}")
        if high != seq_length:
            problems.append(f"{where}.max_value={high} must be seq_length={seq_length}: the schedule ends where no "
                            f"token is dropped")
    if schedule.get("schedule_type") != "fixed_linear":
        problems.append(f"{where}.schedule_type={schedule.get('schedule_type')!r}: DeepSpeed's random-LTD scheduler "
                        f"has fixed_linear only")
    settings = schedule.get("schedule_config")
    for key in ("require_steps", "seq_per_step"):
        value = settings.get(key) if isinstance(settings, Mapping) else None
        if not _positive_int(value):
            problems.append(f"{where}.schedule_config.{key}={value!r} must be a positive integer")
    return problems


def deepspeed_random_ltd(section: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """The section as DeepSpeed's engine and layer wrapper read it (FIXED keys filled in), None when off."""
    if section is None:
        return None
    return {**FIXED, **dict(section), "layer_token_lr_schedule": {"enabled": False}}
