"""Converting checkpoints: GPT-NeoX's layout (this framework's and GPT-NeoX's own), this framework's older
layouts, and Hugging Face folders. The model is described by a ModelConfig throughout.

Reading and writing a ``global_stepN`` directory in any of those layouts is megatron.checkpoint's
(neox_checkpoint, with tensor_parallel's splits); this package translates between it and other formats:

* ``upgrade``: this framework's older layouts -> GPT-NeoX's (tools/ckpts/upgrade_checkpoint.py).
* ``hf_gptneox`` / ``hf_llama`` / ``hf_mamba``: our names and layouts <-> GPTNeoXForCausalLM /
  LlamaForCausalLM / MistralForCausalLM / MambaForCausalLM, with the matching configs.
* ``hf_folder`` and ``tokenizer_files``: reading and writing a local Hugging Face folder.

May import: megatron.errors, utils, tokenizer, model, checkpoint, neox_arguments.
"""
from megatron.errors import ConversionError

__all__ = ["ConversionError"]
