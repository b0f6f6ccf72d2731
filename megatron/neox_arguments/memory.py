"""Will the model fit? A lower bound of one rank's memory, from the validated args, before any process starts.

A typo such as `hidden_size: 1048576` (for 1024) otherwise ends minutes later in the allocator's "13 TB" error as a
traceback. The bound counts what training must hold on each rank and nothing it might not:

* parameters: per layer the attention's query and output projections (2 h^2) and, in layers with an MLP, its up and
  down projections (2 h ffn); the embedding (and the output layer when untied) when the vocabulary is known. The
  key / value projections, biases, norms, experts and gates only add to it;
* model states, split over model_parallel_size x pipeline stages: the weights, their gradients, and the optimizer's
  states (Adam-like: two fp32 moments, and fp32 master weights under 16-bit precision), each divided over the
  data-parallel ranks from the ZeRO stage that partitions it on (1: optimizer states, 2: + gradients, 3: + weights),
  and left out when offloaded (offload_optimizer / offload_param) off the device being checked;
* activations: the layer inputs that activation checkpointing keeps (s b h per layer of the stage), else Korthikanti
  et al.'s 34 s b h bytes per layer at 16-bit (attention scores left out, as flash attention does).

A worker script that does not train (generate.py, eval.py) holds the weights only. The estimate is refused only
when it exceeds the memory of the device (a GPU's, or for CPU ranks their share of the machine's RAM)."""

import dataclasses
from typing import Any, Dict, Optional

from megatron.model.config import ModelConfig

GIB = 2 ** 30
ADAM_LIKE = ("adam", "lamb", "lion", "adafactor", "onebit", "zeroone", "muon")
NO_MLP_LAYERS = ("mamba", "rwkv")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """One rank's lower bound, in bytes, by part."""

    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


def parameters_lower_bound(model: ModelConfig) -> int:
    """At least this many parameters (see the module docstring)."""
    h = model.hidden_size
    layers = sum(2 * h * h + (0 if kind in NO_MLP_LAYERS else 2 * h * model.ffn_width)
                 for kind in model.attention_types)
    if model.num_unique_layers:  # parameters shared between layers
        layers = layers * model.num_unique_layers // max(model.num_layers, 1)
    vocab = (model.padded_vocab_size or 0) * h * (2 if model.no_weight_tying else 1)
    return layers + vocab


def _offloaded(zero: Dict[str, Any], key: str, on_gpu: bool) -> bool:
    device = str((zero.get(key) or {}).get("device") or "none").lower()
    return device == "nvme" or (on_gpu and device == "cpu")


def _least_memory_stage(zero_stage: Any) -> int:
    """The ZeRO stage to count: the configured one, or for an autotuning run's choices (a list, or 'all') the one
    that needs the least memory, so that the estimate stays a lower bound whatever the tuner picks."""
    if zero_stage == "all":
        return 3
    if isinstance(zero_stage, (list, tuple)):
        return max((int(stage) for stage in zero_stage), default=0)
    return int(zero_stage or 0)


def estimate(args: Any, training: bool, on_gpu: bool) -> MemoryEstimate:
    """One rank's lower bound for validated, derived NeoXArgs ``args`` (``training``: train.py's states too)."""
    model = ModelConfig.from_neox_args(args)
    parameters = parameters_lower_bound(model)
    width = 2 if args.precision in ("fp16", "bfloat16") else 4
    stages = max(args.pipe_parallel_size or 0, 1)
    model_split = max(args.model_parallel_size or 1, 1) * stages
    data_parallel = max((args.global_num_gpus or 1) // (model_split * max(args.context_parallel_size or 1, 1)), 1)
    per_rank = parameters // model_split
    zero = args.zero_optimization or {}
    stage = _least_memory_stage(args.zero_stage)
    weights = 0 if _offloaded(zero, "offload_param", on_gpu) else per_rank * width // (data_parallel if stage >= 3
                                                                                        else 1)
    if not training:
        return MemoryEstimate(parameters, weights, 0, 0, 0)
    gradients = per_rank * width // (data_parallel if stage >= 2 else 1)
    optimizer_type = str(args.optimizer_type or "").lower()
    state_bytes = (8 if any(name in optimizer_type for name in ADAM_LIKE) else 0) + (4 if width < 4 else 0)
    optimizer = 0 if _offloaded(zero, "offload_optimizer", on_gpu) else \
        per_rank * state_bytes // (data_parallel if stage >= 1 else 1)
    layers_here = -(-model.num_layers // stages)
    tokens = int(args.train_micro_batch_size_per_gpu or 1) * int(args.seq_length or 1) // max(
        args.context_parallel_size or 1, 1)
    split = max(args.model_parallel_size or 1, 1) if args.sequence_parallel else 1
    per_layer = tokens * model.hidden_size * width // split if args.checkpoint_activations else \
        34 * tokens * model.hidden_size * width // 2 // max(args.model_parallel_size or 1, 1)
    return MemoryEstimate(parameters, weights, gradients, optimizer, layers_here * per_layer)


def _gib(size: float) -> str:
    return f"{size / GIB:,.1f} GiB"


def memory_problem(args: Any, training: bool, device_bytes: int, device: str, on_gpu: bool) -> Optional[str]:
    """Why the model cannot fit ``device_bytes`` per rank, or None; ``device`` says where that memory is, in a
    phrase that ends the sentence "... and each rank has N GiB (``device``)"."""
    need = estimate(args, training, on_gpu)
    if need.total <= device_bytes:
        return None
    parts = [f"weights {_gib(need.weights)}"]
    if training:
        parts += [f"gradients {_gib(need.gradients)}", f"optimizer states {_gib(need.optimizer)}",
                  f"activations {_gib(need.activations)} (train_micro_batch_size_per_gpu="
                  f"{args.train_micro_batch_size_per_gpu} x seq_length={args.seq_length}"
                  f"{', checkpointed' if args.checkpoint_activations else ''})"]
    return (f"the model cannot fit: each rank needs at least {_gib(need.total)} ({need.parameters:,} parameters with "
            f"hidden_size={args.hidden_size}, num_layers={args.num_layers}: {', '.join(parts)}; after "
            f"model_parallel_size={args.model_parallel_size}, pipe_parallel_size={args.pipe_parallel_size}, ZeRO "
            f"stage {int(args.zero_stage or 0)}), and each rank has {_gib(device_bytes)} ({device}). Check "
            f"hidden_size and num_layers for a typo, or shard further (model_parallel_size, pipe_parallel_size, ZeRO "
            f"stage 3, offload_optimizer / offload_param), checkpoint_activations, or a smaller micro-batch")
