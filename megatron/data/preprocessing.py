"""Tokenize documents in parallel worker processes and write them to indexed datasets, in input order.

The tools in tools/datasets/ are thin command lines over this module. Each worker process builds its
own encoder once (from a picklable spec) and receives batches of documents through a bounded queue, so
memory stays flat on large inputs and throughput scales with --workers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.errors import DataError
from megatron.tokenizer import TOKENIZER_TYPES, build_tokenizer_from

Document = dict[str, str]
Encoded = dict[str, np.ndarray]  # output name (e.g. "text_document") -> token ids


class EncoderSpec(Protocol):
    """Picklable recipe; `build()` runs once per worker and returns the batch encoding function."""

    def build(self) -> Callable[[list[Document]], list[Encoded]]: ...

    def output_dtypes(self) -> dict[str, type]: ...


def _fix_text(text: str) -> str:
    try:
        import ftfy
    except ImportError as exc:
        raise DataError("--ftfy needs the `ftfy` package: pip install -r requirements/requirements-data.txt") from exc
    return ftfy.fix_text(text)


@dataclass(frozen=True)
class TextEncoderSpec:
    """Plain pretraining data: each key's text becomes one sequence in `{key}_document`."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    ftfy: bool = False
    vocab_size: int | None = field(default=None, compare=False)

    def output_dtypes(self) -> dict[str, type]:
        return {f"{k}_document": best_fitting_dtype(self.vocab_size) for k in self.keys}

    def build(self) -> Callable[[list[Document]], list[Encoded]]:
        tok = build_tokenizer_from(self.tokenizer_type, self.vocab_file, self.merge_file)
        dtypes = self.output_dtypes()

        def encode(docs: list[Document]) -> list[Encoded]:
            out: list[Encoded] = [{} for _ in docs]
            for key in self.keys:
                texts = [_fix_text(d[key]) if self.ftfy else d[key] for d in docs]
                for o, ids in zip(out, tok.tokenize_batch(texts)):
                    if ids and self.append_eod:
                        ids = list(ids) + [tok.eod]
                    o[f"{key}_document"] = np.asarray(ids, dtype=dtypes[f"{key}_document"])
            return out

        return encode


def _worker_loop(spec: EncoderSpec, inq: mp.Queue, outq: mp.Queue) -> None:
    """Worker process: build the encoder once, then encode batches until the None sentinel."""
    try:
        encode = spec.build()
    except BaseException as exc:  # report any failure to the parent instead of hanging it
        outq.put((-1, f"{type(exc).__name__}: {exc}"))
        return
    while (item := inq.get()) is not None:
        batch_id, docs = item
        try:
            outq.put((batch_id, encode(docs)))
        except BaseException as exc:
            outq.put((-1, f"{type(exc).__name__}: {exc}"))
            return


def _batches(docs: Iterable[Document], batch_size: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for d in docs:
        batch.append(d)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_documents(
    docs: Iterable[Document], spec: EncoderSpec, workers: int = 1, batch_size: int = 64
) -> Iterator[Encoded]:
    """Yield the encoding of each document, in input order, using `workers` processes (1 = in-process)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # --workers is the source of parallelism
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    if workers == 1:
        encode = spec.build()
        for batch in _batches(docs, batch_size):
            yield from encode(batch)
        return
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker_loop, args=(spec, inq, outq), daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    pending: dict[int, list[Encoded]] = {}
    next_out, sent, max_in_flight = 0, 0, 4 * workers

    def receive() -> None:
        while True:
            try:
                batch_id, result = outq.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive()]
                if dead:
                    raise DataError(
                        f"a preprocessing worker exited unexpectedly (exit code {dead[0].exitcode})."
                    ) from None
        if batch_id < 0:
            raise DataError(f"a preprocessing worker failed: {result}")
        pending[batch_id] = result

    completed = False
    try:
        for batch in _batches(docs, batch_size):
            while sent - next_out >= max_in_flight:
                receive()
                while next_out in pending:
                    yield from pending.pop(next_out)
                    next_out += 1
            inq.put((sent, batch))
            sent += 1
        while next_out < sent:
            if next_out not in pending:
                receive()
            while next_out in pending:
                yield from pending.pop(next_out)
                next_out += 1
        completed = True
    finally:
        for _ in procs:
            inq.put(None)
        for p in procs:
            p.join(timeout=5 if completed else 0.1)
            if p.is_alive():
                p.terminate()
                p.join()


@dataclass
class Throughput:
    """Counts for the progress bar and the final report."""

    documents: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    @property
    def seconds(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    def summary(self) -> str:
        s = self.seconds
        return (
            f"{self.documents} documents, {self.tokens} tokens in {s:.2f}s "
            f"({self.documents / s:.1f} docs/s, {self.tokens / s:.0f} tokens/s)"
        )


def output_prefix_for(output_prefix: str, name: str) -> str:
    """`{output_prefix}_{name}`, e.g. data/enwik8_text_document."""
    return f"{output_prefix}_{name}"


def write_indexed_datasets(
    docs: Iterable[Document],
    spec: EncoderSpec,
    output_prefix: str,
    workers: int = 1,
    batch_size: int = 64,
    progress: bool = True,
    log_interval: int | None = None,
    log: Callable[[str], None] = print,
    source: str = "the input",
) -> Throughput:
    """Encode `docs` and write one `{output_prefix}_{name}.bin/.idx` per encoder output; returns the counts.

    Empty sequences are skipped; documents are never dropped, so outputs of one spec stay aligned. Input with
    no document, or no token at all, is a DataError naming `source` (nothing is written): a dataset of zero
    tokens would only fail later, in training.
    """
    dtypes = spec.output_dtypes()
    builders = {n: MMapIndexedDatasetBuilder(output_prefix_for(output_prefix, n), dt) for n, dt in dtypes.items()}
    first_name = next(iter(dtypes))
    stats = Throughput()
    bar = None
    if progress:
        bar = tqdm(unit="docs", file=sys.stderr, mininterval=0.5, miniters=log_interval, dynamic_ncols=True)
    try:
        for enc in encode_documents(docs, spec, workers, batch_size):
            for name, ids in enc.items():
                if ids.size:
                    builders[name].add_item(ids)
                builders[name].end_document()
            stats.documents += 1
            stats.tokens += int(enc[first_name].size)
            if bar is not None:
                bar.update(1)
                if stats.documents % 256 == 0:
                    bar.set_postfix_str(f"{stats.tokens / stats.seconds:.0f} tokens/s", refresh=False)
    except BaseException:
        for b in builders.values():
            b.discard()
        raise
    finally:
        if bar is not None:
            bar.close()
    if stats.documents == 0 or stats.tokens == 0:
        for b in builders.values():
            b.discard()
        found = ("no documents" if stats.documents == 0
                 else f"{stats.documents} documents but no tokens (every text empty)")
        raise DataError(f"{source}: {found}; nothing written to {output_prefix_for(output_prefix, first_name)}"
                        f".bin/.idx (check the input files and the keys that are read from them)")
    for b in builders.values():
        b.finalize()
    log(f"processed {stats.summary()} with {workers} worker(s)")
    for name in dtypes:
        log(f"wrote {output_prefix_for(output_prefix, name)}.bin/.idx")
    return stats


def limit(docs: Iterable[Document], num_docs: int | None) -> Iterator[Document]:
    """Stop after num_docs documents (all when None)."""
    for i, d in enumerate(docs):
        if num_docs is not None and i >= num_docs:
            return
        yield d


def vocab_size_of(tokenizer_type: str, vocab_file: str | None, merge_file: str | None) -> int:
    """Build the tokenizer once in the parent to pick the token dtype and fail early on bad files."""
    return build_tokenizer_from(tokenizer_type, vocab_file, merge_file).vocab_size


def tokenizer_args(parser: argparse.ArgumentParser, required: bool = True) -> argparse._ArgumentGroup:
    """The tokenizer options shared by all preprocessing tools (`required`: --tokenizer-type must be given)."""
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=required, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None, help="tokenizer.json, vocab.json, .model or .tiktoken")
    g.add_argument("--merge-file", default=None, help="merges.txt (GPT2BPETokenizer)")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g.add_argument("--ftfy", action="store_true", help="fix broken unicode with ftfy before tokenizing")
    return g


def runtime_args(parser: argparse.ArgumentParser) -> None:
    """Input/output/parallelism options shared by all preprocessing tools."""
    g = parser.add_argument_group("input/output")
    g.add_argument(
        "--input",
        required=True,
        nargs="+",
        help="files, globs or comma-separated lists "
        "(.jsonl, .jsonl.gz, .jsonl.zst, or plain text: one document per file)",
    )
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--batch-size", type=int, default=64, help="documents per worker task")
    g.add_argument("--num-docs", type=int, default=None, help="stop after this many documents")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (the summary is still printed)")
    g.add_argument("--log-interval", type=int, default=None, help="update the progress bar every N documents")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only the mmap format is written")


def run_cli(args, spec: EncoderSpec, docs: Iterable[Document]) -> Throughput:
    """The common tail of the preprocessing tools: write `docs` with `spec` as the command line asked
    (--output-prefix, --workers, --batch-size, --num-docs, --no-progress, --log-interval)."""
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    keys = getattr(args, "jsonl_keys", None)
    source = f"--input {' '.join(args.input)}" + (f" (jsonl keys {', '.join(keys)})" if keys else "")
    return write_indexed_datasets(limit(docs, args.num_docs), spec, args.output_prefix, args.workers,
                                  args.batch_size, progress=not args.no_progress, log_interval=args.log_interval,
                                  source=source)
