"""Data pipeline: Megatron-compatible indexed datasets, GPT-2 style sample datasets, blending and loaders.

Submodules import numpy/torch; import them directly (e.g. `megatron.data.indexed_dataset`).

May import: megatron.errors, utils, tokenizer, mpu.
"""
