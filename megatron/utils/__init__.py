"""Small helpers every layer may use: optional third-party packages (optional_deps), torch.compile on demand
(lazy_compile), per-rank log files (rank_logs), the DeepSpeed op-build environment (deepspeed_ops), YAML config text (yaml_text) and
UTF-8 text / JSON files read with one clear error (text_files).

May import: megatron.errors.
"""
