"""NeoXArgsTextgen: Sampling and evaluation settings for generate.py and eval.py.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsTextgen:
    """Sampling and evaluation settings for generate.py and eval.py."""

    text_gen_type: Optional[Literal['unconditional', 'input-file', 'interactive', 'precompute']] = None
    """
    How to generate text/sample the model. Options: `unconditional`, `input-file`, `interactive`,
    `precompute` (no text: the loaded model's log-probabilities of every pos_* / neg_* data path P, or of every
    train/valid/test data path of a KTO run, are written to P_{precompute_model_name}, the reference of a DPO or
    KTO run that sets precompute_model_name; any tensor / pipeline split)
    """

    precompute_model_name: Optional[str] = None
    """
    Model name to use for saving precomputed logprobs (text_gen_type `precompute`), and under train_impl `dpo`
    or `kto` the name of the precomputed reference log-probabilities to read instead of running a reference model
    """

    temperature: float = 0.0
    """
    exponential scaling output distribution ("higher == more risk")
    """

    top_p: float = 0.0
    """
    Top-p (nucleus) sampling chooses from the smallest possible set of tokens whose cumulative
    probability exceeds the probability top_p.
    """

    top_k: int = 0
    """
    integer between 0 and the models vocab size. Filters out any logits with a probability less than
    that of the top_kth token.
    """

    return_logits: bool = False
    """
    Boolean for whether to return the logits for generated tokens
    """

    maximum_tokens: int = 64
    """
    maximum number of tokens to be generated
    """

    prompt_end: str = ''
    """
    a single prompt's end. Defaults to newline
    """

    sample_input_file: Optional[str] = None
    """
    Get input from file instead of interactive mode, each line is an input.
    """

    sample_output_file: str = 'samples.txt'
    """
    Output file
    """

    num_samples: int = 1
    """
    Number of samples to generate unconditionally, defaults to 1 and interactive conditional sampling
    """

    recompute: bool = False
    """
    During generation recompute all attention instead of using previously computed keys/values. Should
    be set to true for sparse attention models
    """

    eval_results_prefix: str = ''
    """
    prefix to which to save evaluation results - final fp will be {eval_results_prefix}_eval_results_yy-
    mm-dd-HH-MM.json
    """

    eval_tasks: Optional[list] = None
    """
    lm-evaluation-harness tasks for eval.py, also run by train.py every eval_interval: registry names (their
    datasets come from the Hugging Face hub) or paths to local task YAML files or directories of them
    (offline).
    """
