"""A GPT-NeoX-style framework for training large language models on DeepSpeed.

Importing the package is cheap: subpackages (model, data, mpu, ...) import torch and DeepSpeed
only when they are imported themselves.
"""

__version__ = "0.1.0"
