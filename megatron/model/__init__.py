"""The GPT model: its config, layers, positional encodings, norms, activations, init, KV cache and builders.

Owns ``config.ModelConfig`` (the frozen description of the network, built once per process from NeoXArgs),
``gpt2_model.build_model(config, parallel_state)`` (GPT2ModelPipe, a DeepSpeed PipelineModule, when
pipe_parallel_size >= 1, GPT2ModelSequential otherwise), ``batch`` (inputs, masks, position ids) and the blocks
(attention, MLP, MoE, Mamba, RWKV, gMLP).

May import: megatron.errors, utils, fused_kernels, mpu, mup, data.
"""
