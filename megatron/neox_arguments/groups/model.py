"""NeoXArgsModel: The shape and building blocks of the transformer.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import List, Literal, Optional, Union


@dataclass
class NeoXArgsModel:
    """The shape and building blocks of the transformer."""

    precision: Optional[Literal['fp16', 'fp32', 'bfloat16', 'auto']] = None
    """
    description of the used precision, either one of fp16 or fp32 (and in the future bf16).
    'auto' (this project): bf16 (with DeepSpeed's fp32 master weights) where the machine computes it fast, else
    fp32, decided once by deepy.py on the launching machine: on a GPU, bf16 where torch.cuda.is_bf16_supported();
    on a CPU, bf16 where a bf16 matmul probe runs at least 2x faster than fp32 (1.5x where the CPU advertises
    avx512_bf16 or amx_bf16), as on CPUs with AVX512-BF16 or AMX. The launch prints which it chose and why
    (precision_choice). Not combined with an fp16 or bf16 dict.
    """

    precision_choice: Optional[str] = None
    """
    Derived (this project): what precision 'auto' chose on the launching machine and why, printed once by
    deepy.py; None when precision was not 'auto'.
    """

    num_layers: Optional[int] = None
    """
    Number of transformer layers.
    """

    hidden_size: Optional[int] = None
    """
    Transformer hidden size.
    """

    intermediate_size: Optional[int] = None
    """
    Transformer intermediate size. Default = 4h
    """

    mlp_multiple_of: int = 1
    """
    force mlp size to be a multiple of this value
    """

    expansion_factor: Optional[float] = None
    """
    Transformer intermediate size. Default = 4
    """

    num_attention_heads: Optional[int] = None
    """
    Number of transformer attention heads. If num_kv_heads is set, will control only number of query
    heads.
    """

    num_kv_heads: Optional[int] = None
    """
    Number of transformer key/value attention heads. If set to None or the same value as
    num_attention_heads, will perform multi-head attention (MHA). If set to < num_attention_heads but >
    1, will perform grouped-query attention (GQA) (https://arxiv.org/pdf/2305.13245.pdf) If set to 1,
    will perform multi-query attention. Must be < num_attention_heads and divide num_attention_heads
    evenly.
    """

    seq_length: Optional[int] = None
    """
    Maximum sequence length to process.
    """

    sliding_window_width: Optional[int] = None
    """
    Width of the attention sliding window. Only supported with Flash Attention 2.
    """

    max_position_embeddings: Optional[int] = None
    """
    Maximum number of position embeddings to use. This is the size of position embedding.
    """

    norm: Literal['layernorm', 'non_parametric_layernorm', 'rmsnorm', 'scalenorm', 'te_rmsnorm',
                  'te_layernorm'] = 'layernorm'
    """
    Normalization layer to use. Choose from "layernorm", "non_parametric_layernorm", "rmsnorm", "scalenorm",
    "te_rmsnorm", "te_layernorm". "non_parametric_layernorm" is a LayerNorm without learnable weight or bias
    (as GPT-NeoX's and OLMo's); it uses layernorm_epsilon and cannot be fused (layernorm_fusion).
    """

    layernorm_fusion: bool = False
    """
    Use fused layer norm kernel (if `norm` is `layernorm`).
    """

    rmsnorm_fusion: bool = False
    """
    Use fused RMS norm kernel (if `norm` is `rmsnorm`).
    """

    use_qk_layernorm: bool = False
    """
    Use QK Normalization
    """

    layernorm_epsilon: float = 1e-05
    """
    Layer norm epsilon.
    """

    rms_norm_epsilon: float = 1e-08
    """
    Root mean squared norm epsilon
    """

    scalenorm_epsilon: float = 1e-08
    """
    Scalenorm epsilon
    """

    pos_emb: Literal['learned', 'rotary', 'sinusoidal', 'rpe', 'alibi', 'none'] = 'learned'
    """
    Type of positional embedding to use - choose from 'learned', 'rotary', 'sinusoidal', 'rpe', 'none'
    """

    rpe_num_buckets: int = 32
    """
    T5 relative positional encoding number of buckets, default 32.
    """

    rpe_max_distance: int = 128
    """
    T5 relative positional encoding max distance, default 128.
    """

    opt_pos_emb_offset: int = 0
    """
    Learned position embedding offset (only used by OPT, where it should be set to 2).
    """

    no_weight_tying: bool = False
    """
    Disables weight tying between embedding weights and final Linear layer
    """

    attention_config: Optional[list] = None
    """
    Attention configuration for gpt-neox The first item in the list specifies the attention type(s), and
    should be a list of strings. The second item specifies the number of times to repeat those attention
    types in the full list. attention type choices:  [global, local, sparse_fixed, sparse_variable,
    bslongformer, bigbird, "gmlp", "amlp", "flash", "mamba", "rwkv"] So a 12 layer network with only
    global attention could be specified like: [[[`global`], 12]] or a 12 layer network with alternating
    global / local like: [[[`global`, `local`], 6]] If none is specified, this defaults to [[[`global`],
    n_layers]]
    """

    sparsity_config: Optional[dict] = None
    """
    Sparsity configuration dict as defined in https://www.deepspeed.ai/docs/config-json/#sparse-
    attention Note that since neox is autoregressive, attention is always "unidirectional" and
    `horizontal_global_attention` is always false. The main difference between our sparsity config and
    deepspeed's is that `mode` is ignored - since it is instead specified in attention_config defining
    each layer. An example config is given below: "sparse_attention": { "block": 16,
    "different_layout_per_head": true, "num_local_blocks": 4, "num_global_blocks": 1,
    "num_different_global_patterns": 4, "num_random_blocks": 0, "local_window_blocks": [4],
    "global_block_indices": [0], "global_block_end_indices": None, "num_sliding_window_blocks": 3 }
    Here the layouts are built as DeepSpeed's make_layout builds them and applied as block masks on PyTorch
    SDPA (megatron/model/block_sparse.py, any device); random blocks are seeded by `seed` and the layer
    number. `local` layers read num_local_blocks, else num_sliding_window_blocks, else 4 (3 without a
    sparsity_config). Unknown keys, `mode`, and bidirectional settings are refused.
    """

    num_unique_layers: Optional[int] = None
    """
    Number of unique transformer layers. num-layers should be divisible by this value. Currently only
    has an effect when pipe_parallel_size=0. Here it needs pipe_parallel_size 0 (refused otherwise), layers
    that share parameters must have one attention_config type, and checkpoints store each shared layer once
    (under the slot of its first position).
    """

    param_sharing_style: str = 'grouped'
    """
    Ordering of the shared parameters. For example, for a num-layers=4 and --num-unique-layers=2, we
    will have the following ordering for two unique layers 1 and 2-: grouped: [1, 2, 1, 2] and spaced:
    [1, 1, 2, 2].
    """

    make_vocab_size_divisible_by: int = 128
    """
    Pad the vocab size to be divisible by this value. This is added for computational efficiency
    reasons.
    """

    activation: Literal['gelu', 'geglu', 'relu', 'softsign', 'swish', 'mish', 'silu', 'reglu', 'swiglu', 'bilinear', 'glu'] = 'gelu'
    """
    Activation function to use - choose from ["gelu", "geglu", "relu", "softsign", "swish", "mish",
    "silu", "reglu", "swiglu", "bilinear", "glu"]
    """

    use_flashattn_swiglu: bool = False
    """
    Use flash attention's version of swiglu
    """

    scaled_upper_triang_masked_softmax_fusion: bool = False
    """
    Enable fusion of query_key_value_scaling time (upper diagonal) masking and softmax.
    """

    scaled_masked_softmax_fusion: bool = False
    """
    Enable fusion of query_key_value_scaling general masking and softmax.
    """

    bias_gelu_fusion: bool = False
    """
    Enable bias and gelu fusion.
    """

    bias_dropout_fusion: bool = False
    """
    Enable bias and dropout fusion.
    """

    rope_fusion: bool = False
    """
    Enable rotary embedding fusion.
    """

    fp16_lm_cross_entropy: bool = False
    """
    Move the cross entropy unreduced loss calculation for lm head to fp16.
    """

    init_method_std: float = 0.02
    """
    Standard deviation of the zero mean normal distribution used for weight initialization.
    """

    apply_query_key_layer_scaling: bool = False
    """
    Scale Q * K^T by 1 / layer-number. If this flag is set, then it will automatically set attention-
    softmax-in-fp32 to true
    """

    use_cpu_initialization: bool = False
    """
    If set, affine parallel weights initialization uses CPU
    """

    attention_softmax_in_fp32: bool = False
    """
    Run attention masking and softmax in fp32.
    """

    rotary_pct: float = 1.0
    """
    pct of hidden dims to apply rotary positional embedding to
    """

    rotary_emb_base: int = 10000
    """
    Base for rotary positional embedding
    """

    rope_scaling: Optional[dict] = None
    """
    RoPE scaling as Hugging Face names it in config.json: a dict with rope_type (or type) 'linear', 'dynamic',
    'yarn' or 'llama3' and its parameters: factor (all); low_freq_factor, high_freq_factor and
    original_max_position_embeddings (llama3); original_max_position_embeddings, attention_factor, beta_fast,
    beta_slow, mscale, mscale_all_dim, truncate (yarn, optional). E.g. {rope_type: llama3, factor: 8.0,
    low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192}. The base and the rotated
    share stay rotary_emb_base and rotary_pct. Not a GPT-NeoX argument (GPT-NeoX has no RoPE scaling).
    """

    rotary_save_freqs_buffer: bool = False
    """
    Used to control whether the `inv_freqs` buffer in rotary embeddings will be stored in checkpoints
    (persistent=True) or not. Defaults to false, but is left configurable to maintain backward-
    compatibility with GPT-NeoX checkpoints that were trained with this flag.
    """

    fused_kernels_build_path: Optional[str] = None
    """
    GPT-NeoX's build directory for its CUDA fused kernels. The fused kernels here are Triton kernels,
    compiled just in time into Triton's own cache (TRITON_CACHE_DIR), so there is nothing to build.
    """

    serve_model_weights: bool = False
    """
    Serve model weight pointers over a socket connection (GPT-NeoX's online RL weight server, sharing GPU memory
    with a vLLM fork). Not supported: the rollout server here (tools/rollout_server.py) loads the newest
    checkpoint in save instead.
    """

    weight_server_port: Union[int, List[int]] = 6000
    """
    Port(s) of the weight server: an integer means 6000 + global rank; a list gives one port per rank.
    """

    online_dataserver_ips: Union[str, List[str]] = 'localhost'
    """
    IP address of the online data (rollout) server (dataset_impl 'online'): one for every data-parallel rank, or a
    list with one per data-parallel rank.
    """

    online_dataserver_ports: Union[int, List[int]] = 10000
    """
    Port of the online data (rollout) server (dataset_impl 'online'): one for every data-parallel rank, or a list
    with one per data-parallel rank.
    """

    init_method: Literal['normal', 'scaled_normal', 'orthogonal', 'scaled_orthogonal', 'xavier_uniform', 'xavier_normal', 'wang_init', 'small_init', 'single_residual_scaled_normal'] = 'normal'
    """
    Init function used on all layers except ff residual outputs - choose from ["normal",
    "scaled_normal", "orthogonal", "scaled_orthogonal", "xavier_uniform", "xavier_normal", "wang_init",
    "small_init"]
    """

    output_layer_init_method: Literal['normal', 'scaled_normal', 'orthogonal', 'scaled_orthogonal', 'xavier_uniform', 'xavier_normal', 'wang_init', 'small_init', 'single_residual_scaled_normal'] = 'scaled_normal'
    """
    Init function used for ff residual outputs - choose from ["normal", "scaled_normal", "orthogonal",
    "scaled_orthogonal", "xavier_uniform", "xavier_normal", "wang_init", "small_init"]
    """

    gmlp_attn_dim: int = 64
    """
    The width of the single-head attention of aMLP layers (attention_config type "amlp"); gMLP layers
    ("gmlp") have none. Setting it to anything but its default without amlp layers is refused (nothing
    would read it). Both layer types are built in megatron/model/gmlp.py (width 4 x hidden_size, as in
    GPT-NeoX).
    """

    gpt_j_residual: bool = False
    """
    If false, we use the conventional residual path: x = x + attn(ln1(x)) x = x + mlp(ln2(x)) Otherwise,
    we use the residual path from GPT-J, which offers a slight speedup: x = ln(x) x = x + attn(x) +
    mlp(x)
    """

    gpt_j_tied: bool = False
    """
    If false, we use x = x + attn(ln1(x)) + mlp(ln2(x)) Otherwise, we tie the layer norms y = ln(x) x =
    x + attn(y) + mlp(y)
    """

    use_bias_in_norms: bool = True
    """
    If false, norms (e.g. LayerNorm) will not have bias terms
    """

    use_bias_in_attn_linear: bool = True
    """
    If false, attn_linear (e.g. QKVO) will not have bias terms
    """

    use_bias_in_qkv: Optional[bool] = None
    """
    Whether the query / key / value projection has bias terms, apart from the attention's output projection:
    null (default) follows use_bias_in_attn_linear; true with use_bias_in_attn_linear false is Qwen2's layout
    (biases on q, k and v only). Not a GPT-NeoX argument.
    """

    use_bias_in_mlp: bool = True
    """
    If false, mlps will not have bias terms
    """

    soft_prompt_tuning: Optional[dict] = None
    """
    Dictionary configuring the soft prompt tuning parameters. If enabled, will train *only* the soft
    prompt, and freezes the rest of the model. parameters in the dict are: 'enabled': bool = True #
    enables soft prompting 'num_tokens': int = 10 # length of the soft prompt in tokens 'init_string':
    str = '' # if provided, initialize the soft prompt with the word embeddings of this string
    'init_range': float = 0.5 # if no init string is provided, initialize the soft prompt with a uniform
    distribution between -init_range and init_rang
    """

    lora: Optional[dict] = None
    """
    LoRA adapters (as Hugging Face peft computes them) on the transformer layers' linear layers, every other
    parameter frozen and left out of the optimizer. Keys: r (rank, default 8), alpha (the update is scaled by
    alpha / r; default 8), dropout (on the adapters' input; default 0), target_modules (of query_key_value, dense,
    linear1, linear2 — GPT-NeoX's dense_h_to_4h / dense_4h_to_h name the last two; default [query_key_value]),
    layers_to_transform (layer numbers from 0; default null: every layer). peft's names lora_alpha and lora_dropout
    are accepted. E.g. {r: 16, alpha: 32, target_modules: [query_key_value, dense, linear1, linear2]}. Needs load (the
    base checkpoint) with finetune: true; checkpoints hold the adapters and a pointer to the base. Works with ZeRO
    stages 0-3 (stage 3 at model_parallel_size 1), any tensor / pipeline split (a base saved in another is
    resharded as it loads) and train_impl dpo / kto (the reference is the base: the policy with its adapters off).
    QLoRA (a 4-bit base), ZeRO-3 with tensor parallelism, train_impl rm, and dpo / kto with a reference model at
    pipe_parallel_size > 1 are refused. Not a GPT-NeoX argument (GPT-NeoX has no LoRA). See
    docs/fine-tuning.md.
    """

    mamba_selective_scan_fusion: bool = False
    """
    Enable fused kernels for Mamba selective scan: mamba_ssm's selective_scan_fn on CUDA (training and
    prompt forwards; decoding steps use the PyTorch recurrence). Needs a CUDA GPU and
    requirements/requirements-mamba.txt: refused with a message where the model is built without them. False:
    the pure-PyTorch chunked scan (any device).
    """

    mamba_causal_conv_fusion: bool = False
    """
    Enable fused kernels for Mamba causal Conv1d: causal_conv1d's causal_conv1d_fn on CUDA. Needs a CUDA GPU
    and requirements/requirements-mamba.txt (refused otherwise, as mamba_selective_scan_fusion).
    """

    mamba_inner_func_fusion: bool = False
    """
    Enable fused inner operator for Mamba: mamba_ssm's mamba_inner_fn (conv, projections and scan in one
    kernel; supersedes the conv and selective scan fusion flags). Needs a CUDA GPU and
    requirements/requirements-mamba.txt (refused otherwise); refused with mamba_use_bias_in_linears (as in
    GPT-NeoX) and with model_parallel_size > 1.
    """

    mamba_selective_fp32_params: bool = True
    """
    Keep selected parameters in fp32 for Mamba (A_log and D) when the model is cast to fp16 / bf16; the
    selective scan reads them in fp32 either way.
    """

    mamba_use_bias_in_conv: bool = True
    """
    If false, conv1d in mamba block will not have bias term.
    """

    mamba_use_bias_in_linears: bool = False
    """
    Enable bias terms in mamba block linear layers (in_proj, x_proj and out_proj, as in GPT-NeoX; dt_proj
    always has its bias).
    """

    output_layer_parallelism: Literal['column'] = 'column'
    """
    Parameter controlling whether the output layer is parallelized over the hidden dim (row) or the
    vocab dim (column)
    """

    te_columnparallel: bool = False
    """
    Use Transformer Engine for the ColumnParallelLinear layers. Transformer Engine is not supported yet:
    true is refused.
    """

    te_rowparallel: bool = False
    """
    Use Transformer Engine for the RowParallelLinear layers. Transformer Engine is not supported yet: true is
    refused.
    """

    te_layernorm_mlp: bool = False
    """
    Use Transformer Engine's LayerNormMLP (the norm fused into the MLP). Transformer Engine is not supported
    yet: true is refused.
    """

    te_mha: bool = False
    """
    Use Transformer Engine's MultiheadAttention. Transformer Engine is not supported yet: true is refused.
    """

    te_fp8_format: Literal['e4m3', 'hybrid'] = 'hybrid'
    """
    FP8 format of Transformer Engine layers: "e4m3" in both passes, or "hybrid" (E4M3 forward, E5M2
    backward). Transformer Engine is not supported yet: a value other than the default is refused.
    """

    te_fp8_wgrad: bool = True
    """
    Compute the weight gradients of Transformer Engine layers in FP8 (false: in higher precision).
    Transformer Engine is not supported yet: a value other than the default is refused.
    """

    te_fp8_amax_history_len: int = 1
    """
    Length of the amax history window for Transformer Engine's FP8 scaling factors. Transformer Engine is
    not supported yet: a value other than the default is refused.
    """

    te_fp8_amax_compute_algo: str = 'most_recent'
    """
    How Transformer Engine picks the amax for FP8 scaling: "max" (largest in the history window) or
    "most_recent". Transformer Engine is not supported yet: a value other than the default is refused.
    """

    te_fp8_margin: int = 0
    """
    Margin for Transformer Engine's FP8 scaling-factor computation. Transformer Engine is not supported
    yet: a value other than the default is refused.
    """

    te_fp8_mha: bool = False
    """
    Use Transformer Engine's FP8 multi-head attention. Transformer Engine is not supported yet: true is
    refused.
    """

    dim_att: Optional[int] = None
    """
    Total dimension of the attention mechanism (time mix) for RWKV. If not set, defaults to hidden_size. Must
    be divisible by num_attention_heads.
    """

    head_size: Optional[int] = None
    """
    Size of each attention head for RWKV. Calculated as dim_att // num_attention_heads; when set it must equal
    that (refused otherwise).
    """

    ffn_dim: Optional[int] = None
    """
    Dimension of the feed-forward network (channel mix) for RWKV. If not set, intermediate_size, else
    int(expansion_factor (default 3.5) * hidden_size), rounded down to a multiple of 32 (GPT-NeoX's rule).
    """
