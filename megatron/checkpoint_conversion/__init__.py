"""Converting checkpoints: GPT-NeoX's layout (this framework's and GPT-NeoX's own), this framework's older
layouts, and Hugging Face folders. The model is described by a ModelConfig throughout.

* ``neox_checkpoint``: read a ``global_stepN`` directory in any of those layouts (merging tensor- and
  pipeline-parallel shards into one state dict of the model's parameters, with its ModelConfig) and write one
  in GPT-NeoX's layout, which DeepSpeed's engine loads, for a chosen tensor/pipeline split.
* ``tensor_parallel``: how each parameter is split across tensor-parallel ranks.
* ``upgrade``: this framework's older layouts -> GPT-NeoX's (tools/ckpts/upgrade_checkpoint.py).
* ``hf_gptneox`` / ``hf_llama`` / ``hf_mamba``: our names and layouts <-> GPTNeoXForCausalLM /
  LlamaForCausalLM / MistralForCausalLM / MambaForCausalLM, with the matching configs.
* ``hf_folder`` and ``tokenizer_files``: reading and writing a local Hugging Face folder.
"""
from megatron.errors import ConversionError

__all__ = ["ConversionError"]
