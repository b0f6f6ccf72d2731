"""Tiny duck-typed neox_args for model tests: the reference defaults plus the derived attributes the
model reads (padded_vocab_size, precision, expanded attention_config, ...)."""

from types import SimpleNamespace

REFERENCE_DEFAULTS = dict(
    precision="fp32",
    num_layers=2,
    hidden_size=32,
    intermediate_size=None,
    mlp_multiple_of=1,
    expansion_factor=None,
    num_attention_heads=4,
    num_kv_heads=None,
    seq_length=16,
    sliding_window_width=None,
    max_position_embeddings=None,
    norm="layernorm",
    layernorm_fusion=False,
    rmsnorm_fusion=False,
    use_qk_layernorm=False,
    layernorm_epsilon=1e-5,
    rms_norm_epsilon=1e-8,
    scalenorm_epsilon=1e-8,
    pos_emb="learned",
    rpe_num_buckets=32,
    rpe_max_distance=128,
    opt_pos_emb_offset=0,
    no_weight_tying=False,
    attention_config=None,
    sparsity_config=None,
    num_unique_layers=None,
    param_sharing_style="grouped",
    make_vocab_size_divisible_by=128,
    activation="gelu",
    use_flashattn_swiglu=False,
    init_method_std=0.02,
    apply_query_key_layer_scaling=False,
    use_cpu_initialization=False,
    attention_softmax_in_fp32=False,
    rotary_pct=1.0,
    rotary_emb_base=10000,
    rotary_save_freqs_buffer=False,
    init_method="normal",
    output_layer_init_method="scaled_normal",
    gpt_j_residual=False,
    gpt_j_tied=False,
    use_bias_in_norms=True,
    use_bias_in_attn_linear=True,
    use_bias_in_mlp=True,
    soft_prompt_tuning=None,
    output_layer_parallelism="column",
    pipe_parallel_size=0,
    model_parallel_size=1,
    pipe_partition_method="type:transformer|mlp",
    sequence_parallel=False,
    seed=1234,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    checkpoint_activations=False,
    checkpoint_num_layers=1,
    partition_activations=False,
    contiguous_checkpointing=False,
    checkpoint_in_cpu=False,
    synchronize_each_layer=False,
    profile_backward=False,
    eod_mask_loss=False,
    moe_num_experts=1,
    use_mup=False,
    train_micro_batch_size_per_gpu=2,
    gradient_accumulation_steps=1,
)


def make_neox_args(**overrides) -> SimpleNamespace:
    """Reference defaults for a 2-layer, hidden-32, vocab-128, seq-16 model, with ``overrides``."""
    values = dict(REFERENCE_DEFAULTS)
    values["padded_vocab_size"] = 128
    values.update(overrides)
    if values["attention_config"] is None:
        values["attention_config"] = ["global"] * values["num_layers"]
    values["is_pipe_parallel"] = values["pipe_parallel_size"] >= 1
    values.setdefault(
        "train_batch_size", values["train_micro_batch_size_per_gpu"] * values["gradient_accumulation_steps"]
    )
    return SimpleNamespace(**values)
