#!/usr/bin/env python
"""Worker entry point for text generation; launch it through deepy.py with the model's config (whose
`load` names the checkpoint) and the generation settings:

    python deepy.py generate.py CONFIG.yml configs/text_generation.yml [-i prompts.txt] [-o samples.jsonl]

text_gen_type (left unset: input-file when sample_input_file / -i is given, else unconditional):
  unconditional  num_samples samples, each started from the end-of-document token;
  input-file     one sample per prompt of sample_input_file (prompts separated by prompt_end, a newline
                 when empty);
  interactive    prompts read from standard input, one per line, until EOF or an empty line; each
                 sample is printed as well as written;
  precompute     no samples: the loaded model's log-probabilities of every pos_* / neg_* data path P (DPO) or
                 every train/valid/test data path (KTO) are written to P_{precompute_model_name}, which DPO / KTO
                 training then reads instead of running a reference model (megatron/post_training/precompute.py).

Every sample is one JSON line of sample_output_file: {"context", "text", "length" (new tokens),
"finished" (stopped at the end-of-document token), "duration_seconds" (decoding time of the batch the
sample was in)} plus "logits" (the logits each new token was drawn from, a list of vocabulary-sized
lists) with return_logits. Prompts are truncated from the left and maximum_tokens capped to fit in the
model's sequence length. Prompts are decoded together in batches
of train_micro_batch_size_per_gpu. Every rank runs the model (tensor / pipeline parallel); rank 0 writes.
"""

import json
import os
import sys
from typing import IO, Iterator, List, Optional

from megatron.neox_arguments import NeoXArgs
from megatron.errors import ConfigError
from megatron.utils.text_files import read_utf8


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _interactive_prompts(stream: IO[str]) -> Iterator[str]:
    """Lines from rank 0's standard input, shared with every rank; stops at EOF or an empty line."""
    from megatron.mpu.host_collectives import broadcast_object  # torch is imported by the worker only

    while True:
        line: Optional[str] = None
        if _rank() == 0:
            print("Context prompt >>> ", end="", flush=True)
            raw = stream.readline()
            line = raw.rstrip("\r\n") if raw else ""
        line = broadcast_object(line, src=0)
        if not line or not line.strip():
            return
        yield line


def _file_prompts(neox_args) -> List[str]:
    from megatron.inference.text_generation import GenerationError, split_prompts

    path = neox_args.sample_input_file
    if not path:
        raise GenerationError("text_gen_type='input-file' needs sample_input_file (or -i PROMPTS.txt)")
    if not os.path.isfile(path):
        raise GenerationError(f"sample_input_file not found: {path!r} (set sample_input_file or -i to a text "
                              "file with one prompt per line)")
    prompts = split_prompts(read_utf8(path, GenerationError), neox_args.prompt_end)
    if not prompts:
        raise GenerationError(f"sample_input_file {path!r} holds no prompts")
    return prompts


class SampleWriter:
    """JSONL records on rank 0 (flushed per record, so an interrupted run keeps what it produced)."""

    def __init__(self, path: str, echo: bool) -> None:
        self.path, self.echo, self.count = path, echo, 0
        self.handle = None
        if _rank() == 0:
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            self.handle = open(path, "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.count += 1
        if self.handle is None:
            return
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()
        if self.echo:
            print(f"Generated text: {record['text']}", flush=True)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            print(f"generate.py: wrote {self.count} samples to {self.path}", flush=True)


def generate_samples(neox_args, engine, ctx, stdin: IO[str] = sys.stdin) -> int:
    """Run the configured text_gen_type; returns the number of samples written."""
    import torch

    from megatron.inference.text_generation import (
        GenerationError,
        SamplingParams,
        batches,
        build_runner,
        generate_tokens,
        max_sequence_length,
    )

    mode = neox_args.text_gen_type
    if mode not in ("unconditional", "input-file", "interactive"):
        raise GenerationError(f"text_gen_type={mode!r} is not supported; use unconditional, input-file or "
                              "interactive")
    params = SamplingParams.from_args(neox_args)
    tokenizer = ctx.tokenizer
    runner = build_runner(engine, ctx.parallel_state, ctx.model_config)
    generator = torch.Generator(device=ctx.device).manual_seed(int(neox_args.seed))
    batch_size = int(neox_args.train_micro_batch_size_per_gpu or 1)
    if mode == "unconditional":
        if neox_args.sample_input_file:
            raise GenerationError(f"text_gen_type='unconditional' with sample_input_file="
                                  f"{neox_args.sample_input_file!r}: set text_gen_type to 'input-file' (or leave it "
                                  "unset) to sample from the file, or drop sample_input_file / -i")
        if int(neox_args.num_samples) < 1:
            raise GenerationError(f"num_samples must be >= 1, got {neox_args.num_samples}")
        groups = batches([""] * int(neox_args.num_samples), batch_size)
    elif mode == "input-file":
        groups = batches(_file_prompts(neox_args), batch_size)
    else:
        groups = ([prompt] for prompt in _interactive_prompts(stdin))
    writer = SampleWriter(neox_args.sample_output_file, echo=mode == "interactive")
    try:
        for group in groups:
            token_prompts = [tokenizer.tokenize(text) or [tokenizer.eod] for text in group]
            results = generate_tokens(
                runner, token_prompts, eod=tokenizer.eod, maximum_tokens=int(neox_args.maximum_tokens),
                max_seq_length=max_sequence_length(ctx.model_config), params=params,
                recompute=bool(neox_args.recompute), generator=generator,
                return_logits=bool(neox_args.return_logits),
                vocab_size=tokenizer.vocab_size, device=ctx.device)
            for text, result in zip(group, results):
                record = {"context": text, "text": tokenizer.detokenize(result.tokens), "length": len(result.tokens),
                          "finished": result.finished, "duration_seconds": result.duration_seconds}
                if result.logits is not None:
                    record["logits"] = result.logits.tolist()
                writer.write(record)
    finally:
        writer.close()
    return writer.count


def main() -> int:
    from megatron.errors import CheckpointError, DataError, TokenizerError
    from megatron.utils.optional_deps import MissingOptionalDependency
    from megatron.inference.text_generation import GenerationError

    try:
        neox_args = NeoXArgs.consume_neox_args()
        from megatron.inference.loading import setup_for_inference
        from megatron.inference.text_generation import SamplingParams

        SamplingParams.from_args(neox_args)  # bad sampling options fail before the model is built
        engine, ctx, _ = setup_for_inference(neox_args)
        if neox_args.text_gen_type == "precompute":
            from megatron.post_training.precompute import precompute_reference_logps

            precompute_reference_logps(neox_args, engine, ctx)
        else:
            generate_samples(neox_args, engine, ctx)
        ctx.destroy()
    except (ConfigError, CheckpointError, DataError, TokenizerError, MissingOptionalDependency,
            GenerationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
