"""muP, the maximal update parametrization (Yang et al., Tensor Programs V): hyperparameters tuned on a narrow
model transfer to wide ones.

shapes: base shapes files (which dimensions are width). rules: what the config may ask. parametrization: the
per-parameter side (initialisation, optimizer groups; torch). coord_check: the coordinate check. The train.py
runs that stop instead of training (save_base_shapes, coord_check) are megatron.training.mup_run. The model side (attention 1/d, embedding and output
multipliers) lives in megatron.model, read from ModelConfig.

May import: nothing of megatron.
"""
