"""Using a trained model without training machinery: loading weights for generation and evaluation (loading)
and batched decoding with a KV cache (text_generation).

May import: megatron.errors, utils, mpu, model, checkpoint, initialize.
"""
