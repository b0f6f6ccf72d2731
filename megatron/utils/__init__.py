"""Small helpers every layer may use: optional third-party packages (optional_deps), torch.compile on demand
(lazy_compile), per-rank log files (rank_logs), the DeepSpeed op-build environment (deepspeed_ops), YAML config
text (yaml_text), UTF-8 text / JSON files read with one clear error (text_files), refusing a Hugging Face folder
that asks for its own code (hf_folders), processes that end with their parent (process_tree), glibc's malloc
keeping freed memory for the next step on CPU runs (host_memory).

May import: megatron.errors.
"""
