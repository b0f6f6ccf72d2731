"""Converting checkpoints between this framework's DeepSpeed layout and Hugging Face folders.

* ``neox_checkpoint``: read a ``global_stepN`` directory (merging tensor- and pipeline-parallel shards into
  one state dict with GPT2ModelSequential's names) and write one in exactly the layout DeepSpeed's engine
  loads for a chosen tensor/pipeline split.
* ``tensor_parallel``: how each parameter is split across tensor-parallel ranks.
* ``hf_gptneox`` / ``hf_llama``: our names and layouts <-> GPTNeoXForCausalLM / LlamaForCausalLM /
  MistralForCausalLM, with the matching configs.
* ``hf_folder`` and ``tokenizer_files``: reading and writing a local Hugging Face folder.
"""
from megatron.checkpoint_conversion.errors import ConversionError

__all__ = ["ConversionError"]
