"""ModelConfig: the frozen set of values the model's layers read, and the model's own rules.

The layers never see NeoXArgs (312 fields of launcher, data, logging and optimizer settings): they are
built from a ModelConfig, made once per run by :meth:`ModelConfig.from_neox_args` (the one adapter) or
constructed directly (tests, converters, inference). Every value the layers need that is *derived* from
the user's arguments (head size, key/value heads, MLP width, norm epsilon, rotary width, the per-layer
attention types, the padded vocabulary) is computed here, in ``__post_init__``, and nowhere else.

Field names are GPT-NeoX's argument names with the schema's defaults (a test checks they agree), except
where a GPT-NeoX dict is flattened into plain values: ``soft_prompt_tuning`` becomes ``soft_prompt_tokens``
/ ``soft_prompt_init_range`` (its ``init_string`` becomes ``soft_prompt_init_tokens`` where the tokenizer is known), ``sparsity_config``'s local-window keys become ``local_attention_block``
/ ``local_attention_window_blocks`` (``sparsity_config`` itself is kept as sorted pairs for the block-sparse
layers), DeepSpeed's ``activation_checkpointing.number_checkpoints`` becomes ``number_checkpoints``, and the
muP base model's width in ``base_shapes_file`` becomes ``mup_width_mult`` (megatron.mup.shapes).

The model's rules (:meth:`ModelConfig.problems`: shapes, attention types, which fusion flags apply,
:meth:`ModelConfig.device_problems`: which precision runs where) live here too; NeoXArgs validation
reports them with every other config problem at once. This module does not import torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from megatron.model.lora_settings import lora_problems, normalized_lora
from megatron.model.rope_scaling import normalized_rope_scaling, rope_scaling_problems
from megatron.model.sparsity_config import SPARSE_TYPES, SparsitySettings, freeze, key_problems, local_window
from megatron.mup.rules import mup_model_problems
from megatron.mup.shapes import mup_width_mult

ATTENTION_TYPES = ("global", "local", "flash", "sparse_fixed", "sparse_variable", "bigbird", "bslongformer",
                   "gmlp", "amlp", "mamba", "rwkv")
"""Every layer type GPT-NeoX's attention_config names."""
BUILT_ATTENTION_TYPES = ("global", "local", "flash", "sparse_fixed", "sparse_variable", "bigbird", "bslongformer",
                         "gmlp", "amlp", "mamba", "rwkv")
"""The layer types this model builds."""
GMLP_TYPES = ("gmlp", "amlp")
"""gMLP / aMLP layers (megatron.model.gmlp): a spatial gating unit in place of attention and MLP."""
GMLP_FF_MULT = 4
"""GPT-NeoX's GMLPBlock width: F = 4 x hidden_size (its ff_mult, not configurable)."""
RECURRENT_TYPES = ("mamba", "rwkv")
"""Layer types that carry a recurrent state (no attention: no heads, no positions, no attention mask)."""
NO_PACKED_DOCUMENT_TYPES = GMLP_TYPES + RECURRENT_TYPES
"""Layers that cannot keep packed documents apart without a dense mask (megatron.model.packed_attention)."""
PLAIN_ACTIVATIONS = ("gelu", "relu", "softsign", "swish", "mish", "silu")
GATED_ACTIVATIONS = ("geglu", "reglu", "swiglu", "bilinear", "glu")
"""GLU-family activations: the MLP's first projection is a fused [up | gate] pair."""
GLU_FORMS = {"gelu": "geglu", "relu": "reglu", "silu": "swiglu", "swish": "swiglu"}
"""moe_glu: the GLU form of a plain activation (the experts' activation); gated activations are GLUs already."""
NORMS = ("layernorm", "non_parametric_layernorm", "rmsnorm", "scalenorm")
POSITION_EMBEDDINGS = ("learned", "rotary", "sinusoidal", "rpe", "alibi", "none")
INIT_METHODS = ("normal", "scaled_normal", "orthogonal", "scaled_orthogonal", "xavier_uniform", "xavier_normal",
                "wang_init", "small_init", "single_residual_scaled_normal")
PRECISIONS = ("fp32", "fp16", "bfloat16")
SOFTMAX_FUSION_FLAGS = ("scaled_upper_triang_masked_softmax_fusion", "scaled_masked_softmax_fusion")
LOCAL_ATTENTION_BLOCK = 16
LOCAL_ATTENTION_WINDOW_BLOCKS = 3


def expand_attention_config(config: Optional[Sequence[Any]], num_layers: int) -> Tuple[str, ...]:
    """[[["global", "local"], 6]] -> ("global", "local", ...) of length num_layers (None: all global).

    An already expanded list of strings is returned as it is. Raises ValueError for a malformed entry."""
    if config is None:
        return ("global",) * num_layers
    if all(isinstance(item, str) for item in config):
        return tuple(config)
    layers: List[str] = []
    for item in config:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], (list, tuple))
                and item[0] and all(isinstance(t, str) for t in item[0])):
            raise ValueError(f"each attention_config entry must be [[types...], count], got {item!r}")
        types, count = list(item[0]), item[1]
        if count == "all":
            if len(config) != 1:
                raise ValueError("an attention_config entry with count 'all' must be the only entry")
            return tuple((types * math.ceil(num_layers / len(types)))[:num_layers])
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"attention_config count must be a positive integer or 'all', got {count!r}")
        layers += types * count
    return tuple(layers)


def mlp_width(hidden_size: int, intermediate_size: Optional[int], expansion_factor: Optional[float],
              mlp_multiple_of: int, gated: bool) -> int:
    """Width of the MLP activation (the down projection's input), GPT-NeoX's rule.

    inner = intermediate_size, else int(expansion_factor * hidden), else 4 * hidden. Plain activations:
    inner rounded up to mlp_multiple_of. Gated ones keep the plain MLP's parameter count: each of the two
    halves is int(inner * 2 / 3) // 2, rounded up to mlp_multiple_of."""
    if intermediate_size:
        inner = int(intermediate_size)
    elif expansion_factor:
        inner = int(float(expansion_factor) * hidden_size)
    else:
        inner = 4 * hidden_size
    width = int(inner * 2 / 3) // 2 if gated else inner
    multiple = max(int(mlp_multiple_of), 1)
    return multiple * -(-width // multiple)


EXPERT_WIDTH_MULTIPLE = 256
"""GPT-NeoX's grouped experts round their default width up to a multiple of 256 (not mlp_multiple_of)."""


def expert_width(hidden_size: int, intermediate_size: Optional[int], gated: bool) -> int:
    """Width of one expert's activation, GPT-NeoX's rule (its ParallelGroupedMLP / ParallelGroupedLLaMAMLP):
    intermediate_size when set, else 4 x hidden (plain) or int(8/3 x hidden) (GLU), rounded up to 256."""
    if intermediate_size:
        return int(intermediate_size)
    inner = int(2 * hidden_size * 4 / 3) if gated else 4 * hidden_size
    return EXPERT_WIDTH_MULTIPLE * -(-inner // EXPERT_WIDTH_MULTIPLE)


SHARING_STYLES = ("grouped", "spaced")


def shared_layer_owners(num_layers: int, num_unique_layers: Optional[int], style: str) -> Tuple[int, ...]:
    """Which position owns the parameters of each layer position: Megatron-LM's rule for num_unique_layers U
    (GPT-NeoX documents it): position i uses unique layer i % U ('grouped': [1, 2, 1, 2]) or i // (L / U)
    ('spaced': [1, 1, 2, 2]), and a unique layer lives at the first position that uses it. Without sharing
    (or with settings ModelConfig.problems refuses) every position owns itself."""
    positions = tuple(range(max(num_layers, 0)))
    if num_unique_layers is None or not 1 <= num_unique_layers <= num_layers or num_layers % num_unique_layers \
            or style not in SHARING_STYLES:
        return positions
    unique = [i % num_unique_layers if style == "grouped" else i // (num_layers // num_unique_layers)
              for i in positions]
    return tuple(unique.index(u) for u in unique)


def padded_vocab_size(tokenizer_vocab_size: int, make_vocab_size_divisible_by: int, model_parallel_size: int,
                      explicit: Optional[int] = None) -> int:
    """The tokenizer's vocabulary padded to a multiple of make_vocab_size_divisible_by x model_parallel_size
    (every tensor-parallel rank holds an equal slice); an explicit padded_vocab_size is kept if big enough.
    Raises ValueError naming the key otherwise."""
    if explicit is not None:
        if explicit < tokenizer_vocab_size or explicit % model_parallel_size:
            raise ValueError(f"padded_vocab_size={explicit} must be >= the tokenizer's {tokenizer_vocab_size} tokens "
                             f"and divisible by model_parallel_size={model_parallel_size}")
        return explicit
    multiple = make_vocab_size_divisible_by * model_parallel_size
    return -(-tokenizer_vocab_size // multiple) * multiple


def _soft_prompt(settings: Optional[dict]) -> Tuple[Optional[int], float]:
    """(tokens, init range) of GPT-NeoX's soft_prompt_tuning dict; tokens None when it is off."""
    if not settings or not settings.get("enabled", True):
        return None, 0.5
    tokens = settings.get("n_tokens", 10)
    return int(tokens), float(settings.get("init_range", 0.5))


@dataclass(frozen=True)
class ModelConfig:
    """What the model is (see the module docstring). Construct directly or with from_neox_args."""

    # shape
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    padded_vocab_size: Optional[int] = None
    num_kv_heads: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    intermediate_size: Optional[int] = None
    expansion_factor: Optional[float] = None
    mlp_multiple_of: int = 1
    activation: str = "gelu"
    # norms
    norm: str = "layernorm"
    layernorm_epsilon: float = 1e-05
    rms_norm_epsilon: float = 1e-08
    scalenorm_epsilon: float = 1e-08
    use_bias_in_norms: bool = True
    use_qk_layernorm: bool = False
    # positions
    pos_emb: str = "learned"
    rotary_pct: float = 1.0
    rotary_emb_base: int = 10000
    rotary_save_freqs_buffer: bool = False
    rope_scaling: Optional[Any] = None
    """Hugging Face's rope_scaling (megatron.model.rope_scaling), held as sorted (key, value) pairs; a dict is
    accepted and frozen."""
    rpe_num_buckets: int = 32
    rpe_max_distance: int = 128
    opt_pos_emb_offset: int = 0
    # attention
    attention_config: Optional[Sequence[Any]] = None
    sliding_window_width: Optional[int] = None
    local_attention_block: int = LOCAL_ATTENTION_BLOCK
    local_attention_window_blocks: int = LOCAL_ATTENTION_WINDOW_BLOCKS
    sparsity_config: Optional[Tuple[Tuple[str, Any], ...]] = None
    """GPT-NeoX's sparsity_config as sorted (key, value) pairs (megatron.model.sparsity_config.freeze): the layouts of
    the block-sparse layers (megatron.model.block_sparse)."""
    gmlp_attn_dim: int = 64
    num_unique_layers: Optional[int] = None
    param_sharing_style: str = "grouped"
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = False
    use_bias_in_attn_linear: bool = True
    use_bias_in_qkv: Optional[bool] = None
    use_bias_in_mlp: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # residual and head
    gpt_j_residual: bool = False
    gpt_j_tied: bool = False
    no_weight_tying: bool = False
    train_impl: str = "normal"  # "rm": a scalar value head replaces the output head (reward models)
    z_loss: float = 0.0
    """A reward model's z-loss coefficient: z_loss x mean(r_chosen^2 + r_rejected^2) is added to its loss (GPT-NeoX)."""
    soft_prompt_tokens: Optional[int] = None
    soft_prompt_init_range: float = 0.5
    soft_prompt_init_tokens: Optional[Tuple[int, ...]] = None
    """The token ids of soft_prompt_tuning.init_string (the worker's tokenizer fills them in, megatron.initialize):
    the soft prompt starts as their word embeddings, repeated or cut to its length (GPT-NeoX's SoftEmbedding)."""
    lora: Optional[Any] = None
    """The lora section (megatron.model.lora_settings) with its defaults, held as sorted (key, value) pairs; a dict
    is accepted and frozen. None: no adapters."""
    # recurrent layers: mamba (megatron.model.mamba) and rwkv (megatron.model.rwkv), GPT-NeoX's keys
    mamba_selective_scan_fusion: bool = False
    mamba_causal_conv_fusion: bool = False
    mamba_inner_func_fusion: bool = False
    mamba_selective_fp32_params: bool = True
    mamba_use_bias_in_conv: bool = True
    mamba_use_bias_in_linears: bool = False
    dim_att: Optional[int] = None
    head_size: Optional[int] = None
    ffn_dim: Optional[int] = None
    mamba_inner: int = field(init=False)
    """Mamba's d_inner: intermediate_size, else int(expansion_factor (default 2) * hidden_size)."""
    mamba_dt_rank: int = field(init=False)
    """Rank of Mamba's dt projection: ceil(hidden_size / 16)."""
    rwkv_dim_att: int = field(init=False)
    """RWKV time-mix width: dim_att, else hidden_size."""
    rwkv_head_size: int = field(init=False)
    """rwkv_dim_att // num_attention_heads (the head_size key, when set, must agree)."""
    rwkv_ffn_dim: int = field(init=False)
    """RWKV channel-mix width: ffn_dim, else GPT-NeoX's rule (intermediate_size, else int(expansion_factor
    (default 3.5) * hidden_size)) rounded down to a multiple of 32."""
    # initialisation
    seed: int = 1234
    init_method: str = "normal"
    output_layer_init_method: str = "scaled_normal"
    init_method_std: float = 0.02
    # mixture of experts (megatron.model.moe): which layers, routing, capacity, the experts' parallel layout
    moe_num_experts: int = 1
    expert_interval: int = 2
    moe_top_k: int = 1
    moe_type: str = "megablocks"
    moe_router_type: str = "sinkhorn"
    moe_loss_coeff: float = 0.1
    moe_train_capacity_factor: float = 1.0
    moe_eval_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_token_dropping: bool = False
    moe_use_residual: bool = True
    moe_expert_parallel_size: int = 1
    enable_expert_tensor_parallelism: bool = False
    moe_glu: bool = False
    moe_lbl_in_fp32: bool = False
    moe_jitter_eps: Optional[float] = None
    use_tutel: bool = False
    # muP (megatron.mup): the model's side of the parametrization; the per-parameter side (init, learning rates)
    # comes from base_shapes_file and is applied where the model is trained
    use_mup: bool = False
    mup_init_scale: float = 1.0
    mup_attn_temp: float = 1.0
    """With use_mup the attention scores are q.k / (head_dim x mup_attn_temp) (muP's 1/d, not 1/sqrt(d))."""
    mup_output_temp: float = 1.0
    mup_embedding_mult: float = 1.0
    mup_rp_embedding_mult: float = 1.0
    mup_width_mult: float = 1.0
    """hidden_size over the base model's (read from base_shapes_file by the adapter): with use_mup the output
    head's input is divided by mup_width_mult x mup_output_temp (muP's MuReadout)."""
    # fused kernels (megatron.fused_kernels)
    layernorm_fusion: bool = False
    rmsnorm_fusion: bool = False
    rope_fusion: bool = False
    bias_gelu_fusion: bool = False
    onnx_safe: bool = False
    """GeLU written out from erf (megatron.model.activations.erf_gelu), exportable to any ONNX opset."""
    bias_dropout_fusion: bool = False
    use_flashattn_swiglu: bool = False
    scaled_upper_triang_masked_softmax_fusion: bool = False
    scaled_masked_softmax_fusion: bool = False
    # numerics
    precision: str = "fp32"
    fp16_lm_cross_entropy: bool = False
    # parallel layout and activation checkpointing
    model_parallel_size: int = 1
    pipe_parallel_size: int = 0
    context_parallel_size: int = 1
    """Ranks that split each sequence (ring attention, megatron.model.ring_attention); the layers read the split
    from the ParallelState, this value is for the model's rules (context_parallel_problems)."""
    sequence_parallel: bool = False
    pipe_partition_method: str = "type:transformer|mlp"
    checkpoint_activations: bool = False
    checkpoint_num_layers: int = 1
    recompute_granularity: Optional[str] = None
    """'selective': the attention layers checkpoint their core (megatron.model.attention); 'full' arrives as
    checkpoint_activations."""
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    """With 'full': 'uniform' chunks of recompute_num_layers (= checkpoint_num_layers, which the model uses);
    'block': the layers checkpointed per pipeline stage (``recompute_block_layers``)."""
    number_checkpoints: Optional[int] = None
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    checkpoint_in_cpu: bool = False
    synchronize_each_layer: bool = False
    profile_backward: bool = False

    # derived once, in __post_init__
    attention_types: Tuple[str, ...] = field(init=False)
    """One layer type per layer (attention_config expanded)."""
    kv_heads: int = field(init=False)
    head_dim: int = field(init=False)
    gated_mlp: bool = field(init=False)
    ffn_width: int = field(init=False)
    """Width of the MLP activation (mlp_width's rule)."""
    norm_epsilon: float = field(init=False)
    """The epsilon of the selected norm."""
    rotary_dim: int = field(init=False)
    """Channels of each head that rotary embeddings rotate (0 without rotary)."""
    positions: int = field(init=False)
    """max_position_embeddings, or seq_length when unset."""
    activation_checkpoints: int = field(init=False)
    """Checkpoints DeepSpeed keeps buffers for: number_checkpoints, else ceil(num_layers / checkpoint_num_layers)."""
    layer_owners: Tuple[int, ...] = field(init=False)
    """For each layer position, the position whose parameters it uses (itself unless num_unique_layers shares
    them: ``shared_layer_owners``)."""
    moe_layers: Tuple[int, ...] = field(init=False)
    """The layers (0-based) whose MLP is a mixture of experts: every expert_interval-th from layer 0 when
    moe_num_experts > 1 (GPT-NeoX's ``layer_number % expert_interval == 0``), else none."""
    expert_activation: str = field(init=False)
    """The experts' activation: ``activation``, or its GLU form with moe_glu (GLU_FORMS)."""
    expert_ffn_width: int = field(init=False)
    """Width of each expert's activation: GPT-NeoX's rule for its grouped experts (``expert_width``), or with
    moe_type deepspeed (whose experts are copies of the dense MLP) the dense MLP's rule (``mlp_width``)."""

    def __post_init__(self) -> None:
        def derive(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        try:
            types = expand_attention_config(self.attention_config, int(self.num_layers))
        except ValueError:
            types = ()  # problems() names the malformed entry
        derive("attention_config", types if types else self.attention_config)
        derive("attention_types", types)
        heads = int(self.num_attention_heads)
        derive("kv_heads", int(self.num_kv_heads or heads))
        derive("head_dim", self.hidden_size // heads if heads > 0 else 0)
        derive("gated_mlp", self.activation in GATED_ACTIVATIONS)
        derive("ffn_width", mlp_width(self.hidden_size, self.intermediate_size, self.expansion_factor,
                                      self.mlp_multiple_of, self.gated_mlp))
        derive("norm_epsilon", {"rmsnorm": self.rms_norm_epsilon, "scalenorm": self.scalenorm_epsilon}.get(
            self.norm, self.layernorm_epsilon))
        derive("rotary_dim", int(self.head_dim * float(self.rotary_pct)) if self.pos_emb == "rotary" else 0)
        derive("positions", int(self.max_position_embeddings or self.seq_length))
        scaling = self.rope_scaling
        if isinstance(scaling, Mapping) or (isinstance(scaling, tuple) and not scaling):
            derive("rope_scaling", freeze(normalized_rope_scaling(dict(scaling))))
        if isinstance(self.lora, Mapping) or (isinstance(self.lora, tuple) and not self.lora):
            derive("lora", freeze(normalized_lora(dict(self.lora))))
        derive("activation_checkpoints", int(self.number_checkpoints or
                                             -(-self.num_layers // max(self.checkpoint_num_layers, 1))))
        derive("layer_owners", shared_layer_owners(int(self.num_layers), self.num_unique_layers,
                                                   self.param_sharing_style))
        derive("moe_layers", tuple(i for i in range(int(self.num_layers)) if self.moe_num_experts > 1
                                   and self.expert_interval > 0 and i % self.expert_interval == 0))
        derive("expert_activation", GLU_FORMS.get(self.activation, self.activation) if self.moe_glu
               else self.activation)
        expert_gated = self.expert_activation in GATED_ACTIVATIONS
        derive("expert_ffn_width", mlp_width(self.hidden_size, self.intermediate_size, self.expansion_factor,
                                             self.mlp_multiple_of, expert_gated) if self.moe_type == "deepspeed"
               else expert_width(self.hidden_size, self.intermediate_size, expert_gated))
        for name, value in recurrent_dims(self).items():
            derive(name, value)

    # ---- the adapter ------------------------------------------------------------------------------
    @classmethod
    def from_neox_args(cls, args: Any, padded_vocab_size: Optional[int] = None, **changes: Any) -> "ModelConfig":
        """The model of a NeoXArgs (validated, derived), or of its dict (a checkpoint's neox_args.json);
        ``padded_vocab_size`` once the tokenizer is known (default: the args' own padded_vocab_size, which may
        be None before the tokenizer is built); ``changes``: fields that differ from the args' (inference turns
        sequence parallelism off), so that the one ModelConfig of a worker is built once."""
        if isinstance(args, Mapping):
            args = SimpleNamespace(**args)
        flattened = {"soft_prompt_tuning", "sparsity_config", "activation_checkpointing"}
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.init and f.name not in flattened and hasattr(args, f.name)}
        values["precision"] = getattr(args, "precision", None) or "fp32"
        values["padded_vocab_size"] = padded_vocab_size if padded_vocab_size is not None \
            else getattr(args, "padded_vocab_size", None)
        values["soft_prompt_tokens"], values["soft_prompt_init_range"] = \
            _soft_prompt(getattr(args, "soft_prompt_tuning", None))
        values["number_checkpoints"] = (getattr(args, "activation_checkpointing", None) or {}).get("number_checkpoints")
        values["mup_width_mult"] = mup_width_mult(args)
        sparsity = getattr(args, "sparsity_config", None)
        values["sparsity_config"] = freeze(sparsity)
        if isinstance(sparsity, Mapping) and not key_problems(sparsity, ("local",)):
            values["local_attention_block"], values["local_attention_window_blocks"] = \
                local_window(sparsity, LOCAL_ATTENTION_WINDOW_BLOCKS)
        return cls(**{**values, **changes})

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes`` (derived values recomputed)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return ModelConfig(**{**values, **changes})

    # ---- views ------------------------------------------------------------------------------------
    @property
    def qkv_bias(self) -> bool:
        """The query / key / value projection has biases: use_bias_in_qkv, or use_bias_in_attn_linear when unset."""
        return self.use_bias_in_attn_linear if self.use_bias_in_qkv is None else bool(self.use_bias_in_qkv)

    @property
    def rope_scaling_dict(self) -> Optional[dict]:
        """rope_scaling as Hugging Face's dict (rope_type and its parameters), or None without scaling."""
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def lora_dict(self) -> Optional[dict]:
        """The lora section as a dict (lists for target_modules and layers_to_transform), or None without LoRA."""
        if not self.lora or not isinstance(self.lora, tuple):
            return None
        return {key: list(value) if isinstance(value, tuple) else value for key, value in self.lora}

    @property
    def value_head(self) -> bool:
        """A reward model (train_impl 'rm'): the last slot is a scalar value head, not a vocabulary head."""
        return self.train_impl == "rm"

    @property
    def tied_embeddings(self) -> bool:
        """The output head is the word embedding (never for a reward model, whose head is its value head)."""
        return not self.no_weight_tying and not self.value_head

    @property
    def recompute_block_layers(self) -> Optional[int]:
        """recompute_method 'block' (Megatron-LM's): how many of the first transformer layers of each pipeline stage
        are checkpointed, one layer per checkpoint (the rest keep their activations); recompute_num_layers, by
        default 1 as in Megatron-LM. None for any other recompute setting."""
        if self.recompute_method != "block" or not self.checkpoint_activations:
            return None
        return 1 if self.recompute_num_layers is None else self.recompute_num_layers

    @property
    def is_pipe_parallel(self) -> bool:
        """Built as a DeepSpeed PipelineModule (pipe_parallel_size >= 1, as GPT-NeoX)."""
        return self.pipe_parallel_size >= 1

    @property
    def softmax_fusion(self) -> bool:
        """A fused-softmax flag is on and some layer can use it (flash layers compute their own softmax)."""
        return any(getattr(self, flag) for flag in SOFTMAX_FUSION_FLAGS) and \
            any(kind != "flash" for kind in self.attention_types)

    # ---- rules ------------------------------------------------------------------------------------
    def problems(self) -> List[str]:
        """Everything that makes this model unbuildable, each naming the argument and what is allowed."""
        problems = self._shape_problems()
        if problems:
            return problems
        problems += self._attention_problems()
        problems += self._component_problems()
        problems += fusion_flag_problems(self)
        problems += moe_problems(self)
        problems += recurrent_layer_problems(self)
        problems += gmlp_problems(self)
        problems += sharing_problems(self)
        problems += mup_model_problems(self)
        problems += context_parallel_problems(self, self.context_parallel_size)
        return problems

    def _shape_problems(self) -> List[str]:
        problems = [f"{name}={getattr(self, name)} must be >= 1" for name in
                    ("num_layers", "hidden_size", "num_attention_heads", "seq_length") if getattr(self, name) < 1]
        if problems:
            return problems
        heads, kv, mp = self.num_attention_heads, self.num_kv_heads, self.model_parallel_size
        # The heads split attention layers only: Mamba layers have none (GPT-NeoX's Mamba configs keep a head
        # count that does not divide hidden_size, and GPT-NeoX skips this check for them) and RWKV layers split
        # dim_att into them (recurrent_layer_problems checks those)
        attention_layers = not self.attention_types or \
            any(kind not in RECURRENT_TYPES for kind in self.attention_types)
        if self.hidden_size % heads and attention_layers:
            problems.append(f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={heads}")
        if heads % mp and attention_layers:
            problems.append(f"num_attention_heads={heads} must be divisible by model_parallel_size={mp}")
        if kv is not None:
            if kv < 1 or kv > heads or heads % kv:
                problems.append(f"num_kv_heads={kv} must divide num_attention_heads={heads} (1 <= num_kv_heads <= "
                                f"heads)")
            elif kv % mp:
                problems.append(f"num_kv_heads={kv} must be divisible by model_parallel_size={mp}")
        if self.positions < self.seq_length:
            problems.append(f"max_position_embeddings={self.max_position_embeddings} must be >= "
                            f"seq_length={self.seq_length}")
        elif self.pos_emb == "learned" and self.positions < self.seq_length + self.opt_pos_emb_offset:
            problems.append(f"max_position_embeddings={self.max_position_embeddings} must be >= seq_length + "
                            f"opt_pos_emb_offset = {self.seq_length + self.opt_pos_emb_offset} (GPT-NeoX's learned "
                            f"position table has max_position_embeddings rows, read at position + offset)")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            problems.append(f"intermediate_size={self.intermediate_size} must be >= 1")
        if self.mlp_multiple_of < 1:
            problems.append(f"mlp_multiple_of={self.mlp_multiple_of} must be >= 1")
        if self.padded_vocab_size is not None and self.padded_vocab_size % mp:
            problems.append(f"padded_vocab_size={self.padded_vocab_size} must be divisible by "
                            f"model_parallel_size={mp}")
        return problems

    def _attention_problems(self) -> List[str]:
        problems: List[str] = []
        try:
            expand_attention_config(self.attention_config, self.num_layers)
        except ValueError as exc:
            return [f"attention_config={self.attention_config!r}: {exc}"]
        if len(self.attention_types) != self.num_layers:
            problems.append(f"attention_config expands to {len(self.attention_types)} layers but num_layers="
                            f"{self.num_layers}; the counts in attention_config must add up to num_layers")
        for kind in sorted(set(self.attention_types)):
            if kind not in ATTENTION_TYPES:
                problems.append(f"attention_config: unknown attention type {kind!r}; choose from "
                                f"{', '.join(ATTENTION_TYPES)}")
            elif kind not in BUILT_ATTENTION_TYPES:
                problems.append(f"attention_config: attention type {kind!r} is not supported yet; built types are "
                                f"{', '.join(BUILT_ATTENTION_TYPES)}")
        if self.sliding_window_width is not None and self.sliding_window_width < 1:
            problems.append(f"sliding_window_width={self.sliding_window_width} must be >= 1")
        problems += sparsity_problems(self)
        if self.local_attention_block < 1 or self.local_attention_window_blocks < 1:
            problems.append(f"sparsity_config block={self.local_attention_block} and num_sliding_window_blocks="
                            f"{self.local_attention_window_blocks} must be >= 1")
        problems += rope_scaling_problems(self.rope_scaling_dict if isinstance(self.rope_scaling, tuple)
                                          else self.rope_scaling, self.pos_emb, self.rotary_dim)
        if self.pos_emb == "rotary":
            if not 0 < self.rotary_pct <= 1:
                problems.append(f"rotary_pct={self.rotary_pct} must be in (0, 1]")
            elif (self.rotary_dim < 2 or self.rotary_dim % 2) and not self.hidden_size % self.num_attention_heads:
                problems.append(f"rotary_pct={self.rotary_pct} of head size {self.head_dim} gives {self.rotary_dim} "
                                f"rotated channels; it must be even and >= 2")
        return problems

    def _component_problems(self) -> List[str]:
        problems: List[str] = []
        for name, value, allowed in (("activation", self.activation, PLAIN_ACTIVATIONS + GATED_ACTIVATIONS),
                                     ("norm", self.norm, NORMS), ("pos_emb", self.pos_emb, POSITION_EMBEDDINGS),
                                     ("init_method", self.init_method, INIT_METHODS),
                                     ("output_layer_init_method", self.output_layer_init_method, INIT_METHODS),
                                     ("precision", self.precision, PRECISIONS)):
            if value not in allowed:
                problems.append(f"{name}={value!r} is not supported; choose from {', '.join(allowed)}")
        if self.gpt_j_tied and not self.gpt_j_residual:
            problems.append("gpt_j_tied=true needs gpt_j_residual=true")
        if self.sequence_parallel and self.model_parallel_size == 1:
            problems.append("sequence_parallel=true needs model_parallel_size > 1")
        if self.soft_prompt_tokens is not None and self.soft_prompt_tokens < 1:
            problems.append(f"soft_prompt_tuning.n_tokens={self.soft_prompt_tokens} must be >= 1")
        problems += lora_problems(self.lora_dict if isinstance(self.lora, tuple) else self.lora, self.num_layers,
                                  self.attention_types, self.moe_layers)
        if self.lora and self.soft_prompt_tokens is not None:
            problems.append("lora with soft_prompt_tuning: each freezes the rest of the model for itself; use one")
        if self.lora and self.train_impl == "rm":
            problems.append("lora with train_impl 'rm': not implemented yet (LoRA trains the adapters only, so the "
                            "reward model's new value head would stay frozen at its initial values, and adapter "
                            "checkpoints, merge_lora.py and the peft export hold adapters only); train the reward "
                            "model without lora, or merge the adapters (tools/ckpts/merge_lora.py) and train it on "
                            "the merged model")
        if self.contiguous_checkpointing and not self.partition_activations:
            problems.append("contiguous_checkpointing=true needs partition_activations=true")
        if self.partition_activations and self.sequence_parallel and self.checkpoint_activations:
            problems.append("partition_activations with sequence_parallel is not supported: the checkpointed "
                            "activations already differ across model-parallel ranks")
        if self.pos_emb == "rpe" and self.pipe_parallel_size > 1:
            problems.append(f"pos_emb='rpe' with pipe_parallel_size={self.pipe_parallel_size}: the relative position "
                            f"table is one parameter shared by all layers (as in GPT-NeoX), which cannot span "
                            f"pipeline stages; use pipe_parallel_size 0 or 1")
        if self.checkpoint_num_layers < 1:
            problems.append(f"checkpoint_num_layers={self.checkpoint_num_layers} must be >= 1")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            problems.append(f"recompute_num_layers={self.recompute_num_layers} must be >= 1")
        if self.recompute_method == "block":
            if not self.checkpoint_activations:
                problems.append("recompute_method 'block' needs recompute_granularity: full")
            if self.checkpoint_num_layers != 1:
                problems.append(f"recompute_method 'block' checkpoints each of the first recompute_num_layers layers "
                                f"of a stage on its own; checkpoint_num_layers={self.checkpoint_num_layers} must be 1")
        elif self.recompute_num_layers is not None and (self.recompute_num_layers != self.checkpoint_num_layers
                                                        or not self.checkpoint_activations):
            problems.append(f"recompute_num_layers={self.recompute_num_layers} is the chunk size of full recomputation "
                            f"(checkpoint_activations with checkpoint_num_layers={self.checkpoint_num_layers}); "
                            f"set recompute_granularity: full and one of the two sizes")
        return problems

    def device_problems(self, cuda_available: bool) -> List[str]:
        """What this worker's hardware cannot run (precision_device_problems of this model's precision)."""
        return precision_device_problems(self.precision, cuda_available)


def precision_device_problems(precision: Optional[str], cuda_available: bool) -> List[str]:
    """What this worker's hardware cannot run of ``precision`` (checked where the workers start, before their
    ModelConfig, which needs the tokenizer, is built: deepy.py often runs on a head node without the workers'
    GPUs)."""
    if precision == "fp16" and not cuda_available:
        return ["fp16 needs a CUDA GPU and this worker has none; on CPU use bf16: {enabled: true} or fp32 "
                "(remove the fp16 dict)"]
    return []


CONTEXT_PARALLEL_TYPES = ("global", "flash")
"""Layer types ring attention serves (a flash layer attends like a global one there)."""


def context_parallel_problems(config: ModelConfig, cp: int) -> List[str]:
    """What keeps ``config`` from running with its sequences split over ``cp`` context-parallel ranks."""
    if cp <= 1:  # below 1 is the argument's own error (megatron.neox_arguments.validation)
        return []
    why = f"with context_parallel_size={cp}"
    problems = []
    if config.seq_length % (2 * cp):
        problems.append(f"seq_length={config.seq_length} must be divisible by 2 x context_parallel_size = {2 * cp} "
                        f"(each rank holds two of the 2 x {cp} load-balanced chunks of a sequence)")
    other = sorted(set(config.attention_types) - set(CONTEXT_PARALLEL_TYPES))
    if other:
        problems.append(f"attention_config layer types {other} {why} are not supported yet (ring attention is "
                        f"causal global attention); use {' or '.join(CONTEXT_PARALLEL_TYPES)} layers")
    if config.pos_emb in ("alibi", "rpe"):
        problems.append(f"pos_emb={config.pos_emb!r} {why} is not supported yet (no attention bias in the ring "
                        f"steps); use rotary, learned, sinusoidal or none")
    unsupported = (("sliding_window_width", config.sliding_window_width is not None, "remove it"),
                   ("moe_num_experts", config.moe_num_experts > 1, "set it to 1"),
                   ("soft_prompt_tuning", config.soft_prompt_tokens is not None, "disable it"),
                   ("train_impl", config.train_impl != "normal",
                    "use train_impl 'normal' (the DPO / KTO / reward losses score whole sequences)"),
                   ("recompute_granularity", config.recompute_granularity == "selective",
                    "use full recomputation (checkpoint_activations) or none"),
                   ("attention_dropout", config.attention_dropout > 0, "set it to 0"),
                   ("use_mup", config.use_mup, "set it to false (ring attention scales scores by 1 / sqrt(head_dim))"),
                   *((flag, getattr(config, flag), "set it to false (ring attention computes its softmax in fp32)")
                     for flag in SOFTMAX_FUSION_FLAGS))
    problems += [f"{key} {why} is not supported yet; {fix}" for key, on, fix in unsupported if on]
    return problems


def sparsity_settings(config: ModelConfig, kind: str) -> SparsitySettings:
    """The block-sparse settings of layer type ``kind`` (one of SPARSE_TYPES) from config.sparsity_config."""
    return SparsitySettings.for_type(kind, dict(config.sparsity_config or ()))


def sparsity_problems(config: ModelConfig) -> List[str]:
    """sparsity_config's keys, and each block-sparse layer type's settings (DeepSpeed's rules)."""
    sparsity = config.sparsity_config
    if isinstance(sparsity, tuple):
        sparsity = dict(sparsity)
    problems = key_problems(sparsity, config.attention_types)
    if problems:
        return problems
    for kind in [k for k in SPARSE_TYPES if k in config.attention_types]:
        problems += sparsity_settings(config, kind).problems(int(config.seq_length))
    return problems


def fusion_flag_problems(config: ModelConfig) -> List[str]:
    """Fusion flags that are on although the model has no op for them to replace."""
    problems = []
    if config.layernorm_fusion and config.norm != "layernorm":
        problems.append(f"layernorm_fusion=true fuses norm='layernorm', but norm={config.norm!r}; "
                        + ("use rmsnorm_fusion instead" if config.norm == "rmsnorm" else
                           "set layernorm_fusion to false"))
    if config.rmsnorm_fusion and config.norm != "rmsnorm":
        problems.append(f"rmsnorm_fusion=true fuses norm='rmsnorm', but norm={config.norm!r}; "
                        + ("use layernorm_fusion instead" if config.norm == "layernorm" else
                           "set rmsnorm_fusion to false"))
    if config.rope_fusion and config.pos_emb != "rotary":
        problems.append(f"rope_fusion=true fuses rotary embeddings, but pos_emb={config.pos_emb!r}; "
                        "set rope_fusion to false")
    if config.bias_gelu_fusion and config.activation != "gelu":
        problems.append(f"bias_gelu_fusion=true fuses activation='gelu', but activation={config.activation!r}; "
                        "set bias_gelu_fusion to false")
    if config.onnx_safe and config.bias_gelu_fusion:
        problems.append("onnx_safe=true writes the GeLU out from erf for the ONNX exporter, which a fused bias-GeLU "
                        "kernel would bypass (GPT-NeoX refuses the pair too); set bias_gelu_fusion to false")
    if config.use_flashattn_swiglu and config.activation != "swiglu":
        problems.append(f"use_flashattn_swiglu=true replaces activation='swiglu', but activation="
                        f"{config.activation!r}; set use_flashattn_swiglu to false")
    return problems


MOE_TYPES = ("deepspeed", "megablocks")
MOE_ROUTER_TYPES = ("topk", "sinkhorn")
DEEPSPEED_JITTER_EPS = 0.01
"""The jitter DeepSpeed's gate applies (noisy_gate_policy 'Jitter', multiplicative noise in [1 - eps, 1 + eps])."""
CAPACITY_SETTINGS = ("moe_train_capacity_factor", "moe_eval_capacity_factor", "moe_min_capacity")


def moe_problems(config: ModelConfig) -> List[str]:
    """The rules of the mixture-of-experts settings: each problem names the setting, the value and what is allowed
    (megatron.model.moe builds the layers)."""
    experts, k = config.moe_num_experts, config.moe_top_k
    if experts < 1:
        return [f"moe_num_experts={experts} must be >= 1 (1 means no mixture of experts)"]
    if experts == 1:
        return []
    problems: List[str] = []
    kind, ep, tp = config.moe_type, config.moe_expert_parallel_size, config.model_parallel_size
    if kind not in MOE_TYPES:
        return [f"moe_type={kind!r} is not supported; choose from {', '.join(MOE_TYPES)}"]
    if config.moe_router_type not in MOE_ROUTER_TYPES:
        problems.append(f"moe_router_type={config.moe_router_type!r} is not supported; choose from "
                        f"{', '.join(MOE_ROUTER_TYPES)}")
    elif kind == "deepspeed" and config.moe_router_type != "topk":
        problems.append(f"moe_router_type={config.moe_router_type!r} with moe_type='deepspeed': DeepSpeed's MoE layer "
                        f"routes with its own top-k gate; set moe_router_type: topk or use moe_type: megablocks")
    if config.expert_interval < 1:
        problems.append(f"expert_interval={config.expert_interval} must be >= 1")
    if not 1 <= k <= experts:
        problems.append(f"moe_top_k={k} must be between 1 and moe_num_experts={experts}: each token goes to moe_top_k "
                        f"different experts")
    if ep < 1:
        problems.append(f"moe_expert_parallel_size={ep} must be >= 1")
    elif kind == "megablocks" and tp > 1 and experts % (ep * tp):
        problems.append(f"moe_num_experts={experts} must be divisible by moe_expert_parallel_size x model_parallel_size "
                        f"= {ep} x {tp}: the dropless layer (moe_type megablocks) splits its experts over both")
    elif experts % ep:
        problems.append(f"moe_num_experts={experts} must be divisible by moe_expert_parallel_size={ep} (each "
                        f"expert-parallel rank holds moe_num_experts / moe_expert_parallel_size experts)")
    if config.moe_loss_coeff < 0:
        problems.append(f"moe_loss_coeff={config.moe_loss_coeff} must be >= 0")
    problems += _capacity_problems(config)
    eps = config.moe_jitter_eps
    if eps is not None and not 0 < eps < 1:
        problems.append(f"moe_jitter_eps={eps} must be in (0, 1) (or unset for no jitter)")
    elif eps is not None and kind == "deepspeed" and eps != DEEPSPEED_JITTER_EPS:
        problems.append(f"moe_jitter_eps={eps} with moe_type='deepspeed': DeepSpeed's gate jitters with a fixed eps of "
                        f"{DEEPSPEED_JITTER_EPS} only; set moe_jitter_eps: {DEEPSPEED_JITTER_EPS} or use moe_type: "
                        f"megablocks")
    if config.moe_glu and config.activation not in GATED_ACTIVATIONS and config.activation not in GLU_FORMS:
        problems.append(f"moe_glu=true with activation={config.activation!r}: it has no GLU form; GLU forms exist for "
                        f"{', '.join(GLU_FORMS)} (and the gated activations are GLUs already)")
    if config.enable_expert_tensor_parallelism and kind == "megablocks":
        problems.append("enable_expert_tensor_parallelism=true with moe_type='megablocks': the dropless layer always "
                        "splits its experts over the tensor-parallel ranks by expert (as GPT-NeoX's dMoE); expert "
                        "tensor parallelism is DeepSpeed's (moe_type: deepspeed)")
    elif config.enable_expert_tensor_parallelism and tp == 1:
        problems.append("enable_expert_tensor_parallelism=true needs model_parallel_size > 1 (the experts are split "
                        "over the tensor-parallel ranks)")
    if config.use_tutel and kind == "megablocks":
        problems.append("use_tutel=true with moe_type='megablocks': tutel only accelerates DeepSpeed's layer "
                        "(moe_type: deepspeed)")
    return problems


def _capacity_problems(config: ModelConfig) -> List[str]:
    problems = []
    for name in ("moe_train_capacity_factor", "moe_eval_capacity_factor"):
        if getattr(config, name) <= 0:
            problems.append(f"{name}={getattr(config, name)} must be > 0")
    if config.moe_min_capacity < 0:
        problems.append(f"moe_min_capacity={config.moe_min_capacity} must be >= 0")
    if not config.moe_token_dropping:
        defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in CAPACITY_SETTINGS}
        for name in CAPACITY_SETTINGS:
            if getattr(config, name) != defaults[name]:
                problems.append(f"{name}={getattr(config, name)} only applies with moe_token_dropping: true (without "
                                f"dropping every token reaches its experts, whatever the capacity); remove it or "
                                f"set moe_token_dropping: true")
    return problems


MAMBA_STATE_SIZE = 16
"""Mamba's d_state (state channels per inner channel), fixed as in GPT-NeoX and mamba_ssm's defaults."""
MAMBA_CONV_WIDTH = 4
"""Mamba's causal depthwise convolution width (d_conv)."""
CAUSAL_CONV1D_CHANNEL_MULTIPLE = 8
"""causal_conv1d's CUDA kernel (mamba_causal_conv_fusion) takes a channel-last input, the layer's [b, s, d] view,
only when its channels d and strides are multiples of 8 ("causal_conv1d only supports channel dimension divisible
by 8 for now")."""
MAMBA_FUSION_FLAGS = ("mamba_selective_scan_fusion", "mamba_causal_conv_fusion", "mamba_inner_func_fusion")
MAMBA_SETTINGS = MAMBA_FUSION_FLAGS + ("mamba_selective_fp32_params", "mamba_use_bias_in_conv",
                                       "mamba_use_bias_in_linears")
RWKV_SETTINGS = ("dim_att", "head_size", "ffn_dim")


def recurrent_dims(config: ModelConfig) -> dict:
    """The derived widths of Mamba and RWKV layers (GPT-NeoX's rules), computed whatever the layer types so
    that every ModelConfig has them; only the layers of that type read them."""
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    if config.intermediate_size:
        mamba_inner, rwkv_ffn = int(config.intermediate_size), int(config.intermediate_size)
    else:
        mamba_inner = int(float(config.expansion_factor or 2) * hidden)
        rwkv_ffn = int(float(config.expansion_factor or 3.5) * hidden)
    dim_att = int(config.dim_att or hidden)
    return {"mamba_inner": mamba_inner, "mamba_dt_rank": -(-hidden // 16), "rwkv_dim_att": dim_att,
            "rwkv_head_size": dim_att // heads if heads > 0 else 0,
            "rwkv_ffn_dim": int(config.ffn_dim) if config.ffn_dim else rwkv_ffn // 32 * 32}


def sharing_problems(config: ModelConfig) -> List[str]:
    """The rules of parameter sharing (num_unique_layers, param_sharing_style)."""
    unique, layers, style = config.num_unique_layers, config.num_layers, config.param_sharing_style
    if style not in SHARING_STYLES:
        return [f"param_sharing_style={style!r} must be one of {', '.join(SHARING_STYLES)}"]
    if unique is None:
        return [] if style == "grouped" else [f"param_sharing_style={style!r} orders shared layers but "
                                              f"num_unique_layers is not set; set it or remove param_sharing_style"]
    if not 1 <= unique <= layers or layers % unique:
        return [f"num_unique_layers={unique} must divide num_layers={layers} (1 <= num_unique_layers <= num_layers)"]
    problems = []
    if config.pipe_parallel_size >= 1:
        problems.append(f"num_unique_layers with pipe_parallel_size={config.pipe_parallel_size} is not supported: "
                        f"DeepSpeed's pipeline ties modules through one weight attribute, not whole layers (GPT-NeoX "
                        f"documents sharing for pipe_parallel_size 0 only); set pipe_parallel_size: 0")
    types = config.attention_types
    mixed = sorted({(config.layer_owners[i], i) for i in range(len(types))
                    if types[config.layer_owners[i]] != types[i]})
    if mixed:
        owner, position = mixed[0]
        problems.append(f"num_unique_layers={unique} ({style}) shares layer {owner}'s parameters with layer "
                        f"{position}, but attention_config makes them {types[owner]!r} and {types[position]!r}; "
                        f"layers that share parameters must have one type")
    if "rwkv" in types:
        problems.append("num_unique_layers with rwkv layers is not supported: GPT-NeoX's first RWKV layer normalises "
                        "its input once more, so it cannot stand in for a later one")
    if config.moe_num_experts > 1:
        problems.append("num_unique_layers with a mixture of experts (moe_num_experts > 1) is not supported yet")
    return problems


def gmlp_problems(config: ModelConfig) -> List[str]:
    """The rules of gMLP / aMLP layers (megatron.model.gmlp), and gmlp_attn_dim without aMLP layers."""
    kinds = set(config.attention_types) & set(GMLP_TYPES)
    default_dim = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == "gmlp_attn_dim")
    if "amlp" not in kinds and config.gmlp_attn_dim != default_dim:
        return [f"gmlp_attn_dim={config.gmlp_attn_dim} is the width of aMLP layers' attention but attention_config "
                f"has no 'amlp' layer; remove it"]
    if not kinds:
        return []
    layers = " / ".join(sorted(kinds))
    problems = []
    if "amlp" in kinds and config.gmlp_attn_dim < 1:
        problems.append(f"gmlp_attn_dim={config.gmlp_attn_dim} must be >= 1")
    if config.gated_mlp:
        problems.append(f"activation={config.activation!r} with {layers} layers: they split their own projection into "
                        f"[residual | gate], so a GLU activation does not apply; use a plain activation "
                        f"({', '.join(PLAIN_ACTIVATIONS)})")
    if config.sequence_parallel:
        problems.append(f"sequence_parallel with {layers} layers is not supported: their spatial projection mixes "
                        f"the whole sequence on every rank")
    if config.moe_num_experts > 1:
        problems.append(f"a mixture of experts (moe_num_experts={config.moe_num_experts}) with {layers} layers is not "
                        f"supported: those layers have no MLP for the experts to replace")
    return problems


def recurrent_layer_problems(config: ModelConfig) -> List[str]:
    """The rules of Mamba and RWKV layers, and their settings on a model without such layers."""
    kinds = set(config.attention_types)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.init}
    problems = []
    for kind, settings in (("mamba", MAMBA_SETTINGS), ("rwkv", RWKV_SETTINGS)):
        if kind not in kinds:
            problems += [f"{name}={getattr(config, name)!r} is a setting of {kind} layers but attention_config has "
                         f"none; remove it" for name in settings if getattr(config, name) != defaults[name]]
    if not kinds & set(RECURRENT_TYPES):
        return problems
    recurrent = sorted(kinds & set(RECURRENT_TYPES))
    if config.intermediate_size is not None and config.expansion_factor is not None:
        problems.append(f"intermediate_size and expansion_factor are both set; {' / '.join(recurrent)} layers take "
                        f"one of them (as in GPT-NeoX)")
    if config.sequence_parallel:
        problems.append(f"sequence_parallel with {' / '.join(recurrent)} layers is not supported yet: their "
                        f"recurrence runs over the whole sequence on every rank")
    if config.moe_num_experts > 1:
        problems.append(f"a mixture of experts (moe_num_experts={config.moe_num_experts}) with "
                        f"{' / '.join(recurrent)} layers is not supported yet: those layers have no MLP for the "
                        f"experts to replace; use attention layers only, or moe_num_experts: 1")
    tp = config.model_parallel_size
    if "mamba" in kinds:
        if config.mamba_inner % tp:
            problems.append(f"Mamba's inner width {config.mamba_inner} (intermediate_size, or expansion_factor x "
                            f"hidden_size) must be divisible by model_parallel_size={tp}")
        elif config.mamba_causal_conv_fusion and (config.mamba_inner // tp) % CAUSAL_CONV1D_CHANNEL_MULTIPLE:
            problems.append(
                f"mamba_causal_conv_fusion=true needs Mamba's inner width per tensor-parallel rank to be a multiple "
                f"of {CAUSAL_CONV1D_CHANNEL_MULTIPLE} (causal_conv1d's CUDA kernel refuses other widths for the "
                f"layer's channel-last input); it is {config.mamba_inner} / model_parallel_size={tp} = "
                f"{config.mamba_inner // tp}. Make intermediate_size (or expansion_factor x hidden_size) a multiple "
                f"of {CAUSAL_CONV1D_CHANNEL_MULTIPLE * tp}, or set mamba_causal_conv_fusion to false")
        if config.mamba_inner_func_fusion and config.mamba_use_bias_in_linears:
            problems.append("mamba_inner_func_fusion=true with mamba_use_bias_in_linears=true: the fused inner "
                            "function has no in_proj / x_proj bias (GPT-NeoX refuses it too)")
        if config.mamba_inner_func_fusion and tp > 1:
            problems.append(f"mamba_inner_func_fusion=true with model_parallel_size={tp} is not supported: the "
                            f"fused inner function cannot sum x_proj's output over tensor-parallel ranks; use "
                            f"mamba_selective_scan_fusion / mamba_causal_conv_fusion")
    if "rwkv" in kinds:
        heads, dim_att = config.num_attention_heads, config.rwkv_dim_att
        if dim_att % heads:
            problems.append(f"RWKV's dim_att={dim_att} must be divisible by num_attention_heads={heads}")
        elif config.head_size is not None and config.head_size != config.rwkv_head_size:
            problems.append(f"head_size={config.head_size} must equal dim_att / num_attention_heads = "
                            f"{config.rwkv_head_size} (GPT-NeoX derives it so)")
        if heads % tp:
            problems.append(f"RWKV's heads (num_attention_heads={heads}) must be divisible by "
                            f"model_parallel_size={tp}")
        if config.rwkv_ffn_dim < 1 or config.rwkv_ffn_dim % tp:
            problems.append(f"RWKV's ffn_dim={config.rwkv_ffn_dim} must be >= 1 and divisible by "
                            f"model_parallel_size={tp}")
    return problems


def recurrent_only_warning(config: ModelConfig) -> Optional[str]:
    """The warning for transformer-layer settings on a model whose layers are all mamba / rwkv (GPT-NeoX's
    configs set gpt_j_residual and activation there): those layers have their own fixed residual and
    activations (Mamba's SiLU, RWKV's squared ReLU) and no attention to rotate or bias (rotary, alibi, rpe),
    so the settings reach no layer."""
    if not config.attention_types or not all(kind in RECURRENT_TYPES for kind in config.attention_types):
        return None
    settings = [name for name, default in (("gpt_j_residual", False), ("activation", "gelu"))
                if getattr(config, name) != default]
    if config.pos_emb in ("rotary", "alibi", "rpe"):  # applied inside attention layers only
        settings.append("pos_emb")
    if not settings:
        return None
    kinds = " / ".join(sorted(set(config.attention_types)))
    values = ", ".join(f"{name}={getattr(config, name)!r}" for name in settings)
    verb = "has" if len(settings) == 1 else "have"
    return (f"{values} {verb} no effect: every layer is a {kinds} layer, with its own fixed residual and "
            f"activations and no attention (as in GPT-NeoX); remove {'it' if len(settings) == 1 else 'them'} to "
            f"silence this warning")


def softmax_fusion_warning(config: ModelConfig) -> Optional[str]:
    """The warning for a fused-softmax flag on a model whose layers are all 'flash' (GPT-NeoX's Pythia,
    Mistral and Llama-2 configs set both): flash attention computes its own softmax, so nothing is fused."""
    flags = [flag for flag in SOFTMAX_FUSION_FLAGS if getattr(config, flag)]
    if flags and config.attention_types and all(kind == "flash" for kind in config.attention_types):
        return (f"{' / '.join(flags)}=true has no effect: every layer uses 'flash' attention, which computes its "
                f"own softmax (as in GPT-NeoX)")
    return None

