"""Triton kernels (forward and backward) behind the fused ops of :mod:`megatron.fused_kernels`.

Every module here imports triton at its top, so import them only through
:func:`megatron.fused_kernels.triton_support.load_kernels`.
"""
