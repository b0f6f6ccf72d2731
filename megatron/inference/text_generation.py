"""Batched text generation: sampling filters, a model runner that returns full-vocabulary logits on every
rank whatever the parallel layout, and the decoding loop used by generate.py (and by eval.py's
generate_until).

Several prompts are decoded together, **left-padded** to the longest one, so that every row appends its
next token at the same slot and one KV cache serves the batch:

* ``attention_mask`` (True = masked, GPT-NeoX's convention) hides the pad slots from every query; a pad
  query may attend to itself only, so that no row of the softmax is empty (an all-masked row would give
  NaN, which would leak through the values even under a zero weight);
* ``position_ids`` count real tokens only (a row's first real token has position 0), which is what the
  learned / sinusoidal embeddings read. Rotary, ALiBi and relative (rpe) encodings depend only on the
  distance between slots, which the padding does not change, so a left-padded row gives the same logits
  as the prompt alone (up to float rounding).

With ``recompute=False`` the prompt goes through the model once and each new token is one forward over a
single slot with the model's explicit ``KVCache``; with ``recompute=True`` the whole sequence is run
again for every token. Both give the same tokens. With pipe_parallel_size > 1 the stages run through
DeepSpeed's PipelineEngine.eval_batch, which has no cache: generation always recomputes there.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional, Sequence

import torch

from megatron.model.batch import causal_only_mask
from megatron.model.config import GMLP_TYPES, RECURRENT_TYPES, ModelConfig
from megatron.model.gpt2_model import BLOCK_CLASSES, GPT2ModelPipe, model_dtype
from megatron.model.kv_cache import KVCache
from megatron.mpu import gather_from_model_parallel_region
from megatron.mpu.host_collectives import broadcast

LogitsFn = Callable[..., torch.Tensor]  # (tokens, position_ids, attention_mask, kv_cache, last_only=False)


class GenerationError(ValueError):
    """Bad generation settings or input (the message names the option); worker scripts exit 2 with it."""


# --------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature / top_k / top_p as in GPT-NeoX: greedy (argmax) when all three are zero."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0 (0 switches it off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in [0, 1] (0 switches it off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 and self.top_k == 0 and self.top_p == 0.0

    @classmethod
    def from_args(cls, neox_args) -> "SamplingParams":
        return cls(temperature=float(neox_args.temperature or 0.0), top_k=int(neox_args.top_k or 0),
                   top_p=float(neox_args.top_p or 0.0))


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit outside the top_k largest and outside the smallest set whose probability
    reaches top_p (the most likely token is always kept). ``logits`` is [batch, vocab]."""
    logits = logits.clone()
    if top_k > 0:
        k = min(top_k, logits.size(-1))
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative > top_p
        drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()  # keep the token that crosses top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None
                ) -> torch.Tensor:
    """Next token ids [batch] from the last position's logits [batch, vocab]."""
    logits = logits.float()
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    if params.temperature > 0:
        logits = logits / params.temperature
    logits = filter_logits(logits, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# --------------------------------------------------------------------------------------------------
# Running the model
# --------------------------------------------------------------------------------------------------
class ModelRunner:
    """Full-vocabulary logits [batch, seq, padded_vocab] on every rank of the model's tensor- and
    pipeline-parallel groups (forward only, no gradients)."""

    supports_cache: bool = True
    recurrent: bool = False
    """True when the model has Mamba / RWKV layers, which see left padding only through a KV cache, or gMLP /
    aMLP layers, which refuse it there (their spatial projection mixes absolute slots)."""

    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 kv_cache: Optional[KVCache] = None, last_only: bool = False) -> torch.Tensor:
        """Logits; with `last_only` a runner may return those of the last position alone ([batch, 1, vocab])."""
        raise TypeError(f"{type(self).__name__} must implement __call__")


class SequentialRunner(ModelRunner):
    """A GPT2ModelSequential (all layers on this rank); the vocabulary shards are gathered over TP."""

    def __init__(self, model: torch.nn.Module, parallel_state) -> None:

        self.model = model
        recurrent = tuple(BLOCK_CLASSES[kind] for kind in RECURRENT_TYPES + GMLP_TYPES)
        self.recurrent = any(isinstance(module, recurrent) for module in model.modules())
        self.group = parallel_state.get_model_parallel_group() \
            if parallel_state.get_model_parallel_world_size() > 1 else None

    @torch.no_grad()
    def __call__(self, tokens, position_ids, attention_mask, kv_cache=None, last_only=False):
        logits = self.model((tokens, position_ids, attention_mask), kv_cache=kv_cache,
                            logits_to_keep=1 if last_only else None)
        return gather_from_model_parallel_region(logits, self.group) if self.group is not None else logits


class PipelineRunner(ModelRunner):
    """pipe_parallel_size > 1: one PipelineEngine.eval_batch per forward; the last stage gathers the
    vocabulary shards and broadcasts the logits to the other stages. No KV cache (the engine's schedule
    only passes activations between stages)."""

    supports_cache = False

    def __init__(self, engine, parallel_state, padded_vocab_size: int, dtype: torch.dtype,
                 recurrent: bool = False) -> None:
        self.engine, self.ps, self.recurrent = engine, parallel_state, recurrent
        self.vocab, self.dtype = int(padded_vocab_size), dtype
        self.tp_group = parallel_state.get_model_parallel_group() \
            if parallel_state.get_model_parallel_world_size() > 1 else None
        self.last_stage_rank = parallel_state.group_ranks("pipe")[-1]

    @torch.no_grad()
    def __call__(self, tokens, position_ids, attention_mask, kv_cache=None, last_only=False):
        if kv_cache is not None:
            raise ValueError("pipe_parallel_size > 1 generation cannot use a KV cache (recompute only)")
        if attention_mask is not None and self.recurrent:
            raise GenerationError("prompts of different lengths (left-padded) cannot be decoded together with "
                                  "pipe_parallel_size > 1 and mamba / rwkv / gmlp layers: those layers see padding "
                                  "only through the KV cache, which the pipeline cannot pass; decode prompts of one "
                                  "length per batch, or with pipe_parallel_size=1")
        if attention_mask is None:  # activations between stages must be tensors: the causal-only mask
            attention_mask = causal_only_mask(tokens.device)
        engine = self.engine
        engine.reset_activation_shape()  # every call may have a new sequence length
        # eval_batch accumulates the last stage's outputs (our logits) across calls; start afresh.
        engine.total_loss, engine.fwd_outputs = None, []
        labels = (torch.zeros_like(tokens), torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device))
        batch = ((tokens, position_ids, attention_mask), labels)
        result = engine.eval_batch(iter([batch]), return_logits=True, compute_loss=False, reduce_output=None,
                                   bcast_loss=False, num_micro_batches=1)
        engine.total_loss, engine.fwd_outputs = None, []
        if self.ps.is_last_pipe_stage():
            logits = result[1]
            if self.tp_group is not None:
                logits = gather_from_model_parallel_region(logits, self.tp_group)
            logits = logits.contiguous()
        else:
            logits = torch.empty(tokens.shape + (self.vocab,), dtype=self.dtype, device=tokens.device)
        return broadcast(logits, src=self.last_stage_rank, group=self.ps.get_pipe_parallel_group())


def build_runner(engine, parallel_state, config: ModelConfig) -> ModelRunner:
    """The runner for a model as setup_for_inference returns it (a DeepSpeed engine or a bare module)."""
    if config.sequence_parallel and parallel_state.get_model_parallel_world_size() > 1:
        raise GenerationError("generation / evaluation cannot run a model built with sequence_parallel=True "
                              "(it splits fixed-length sequences between ranks); build it with "
                              "sequence_parallel=False (same weights), as generate.py and eval.py do")
    module = getattr(engine, "module", engine)
    if isinstance(module, GPT2ModelPipe):
        if module.num_stages == 1:
            return SequentialRunner(module.to_sequential(), parallel_state)

        return PipelineRunner(engine, parallel_state, config.padded_vocab_size, model_dtype(config),
                              recurrent=any(t in RECURRENT_TYPES + GMLP_TYPES for t in config.attention_types))
    return SequentialRunner(module, parallel_state)


# --------------------------------------------------------------------------------------------------
# Padding
# --------------------------------------------------------------------------------------------------
def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, length: Optional[int] = None):
    """(tokens [b, length], real [b, length] bool): each prompt right-aligned after pad slots."""
    length = max(len(p) for p in prompts) if length is None else length
    tokens = torch.full((len(prompts), length), int(pad_id), dtype=torch.long)
    real = torch.zeros((len(prompts), length), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if prompt:
            tokens[row, length - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            real[row, length - len(prompt):] = True
    return tokens, real


def padded_position_ids(real: torch.Tensor) -> torch.Tensor:
    """Position of each slot counting real tokens only (pad slots get 0)."""
    return (real.long().cumsum(dim=-1) - 1).clamp(min=0)


def padded_attention_mask(real: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """[b, 1, end - start, end] bool, True where query slot start+i may NOT attend key slot j: pad keys are
    masked (causality is the model's own); a pad query sees itself only."""
    b, s = real.size(0), end - start
    masked = (~real[:, :end]).view(b, 1, 1, end).expand(b, 1, s, end)
    own = torch.zeros(s, end, dtype=torch.bool, device=real.device)
    own[torch.arange(s, device=real.device), torch.arange(start, end, device=real.device)] = True
    pad_query = (~real[:, start:end]).view(b, 1, s, 1)
    return torch.where(pad_query, ~own, masked)


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Generation:
    """One prompt's result: the (possibly left-truncated) prompt ids, the new ids (without the EOD that
    stopped it), whether EOD stopped it, and, with return_logits, the logits [len(tokens) (+1 with the
    EOD), vocab] from which each new token was drawn."""

    prompt: List[int]
    tokens: List[int]
    finished: bool
    logits: Optional[torch.Tensor] = None
    duration_seconds: float = 0.0


def generate_tokens(runner: LogitsFn, prompts: Sequence[Sequence[int]], *, eod: int, maximum_tokens: int,
                    max_seq_length: int, params: SamplingParams = SamplingParams(), recompute: bool = False,
                    generator: Optional[torch.Generator] = None, return_logits: bool = False,
                    vocab_size: Optional[int] = None, stop_at_eod: bool = True,
                    device: Optional[torch.device] = None) -> List[Generation]:
    """Decode the prompts together (see module docstring) for up to ``maximum_tokens`` new tokens each.

    A prompt longer than ``max_seq_length - 1`` keeps its last tokens; the number of new tokens is capped
    so that prompt + new tokens fit in ``max_seq_length``. Ids >= ``vocab_size`` (the padding of the
    embedding) are never sampled. Every rank must call this with the same prompts and an identically
    seeded ``generator``: the logits are identical on all ranks, so are the tokens.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt needs at least one token (use [eod] for unconditional samples)")
    if max_seq_length < 2:
        raise GenerationError(f"the model's sequence length ({max_seq_length}) leaves no room to generate")
    if maximum_tokens < 1:
        raise GenerationError(f"maximum_tokens must be >= 1, got {maximum_tokens}")
    started = time.perf_counter()
    prompts = [list(p)[-(max_seq_length - 1):] for p in prompts]
    width = max(len(p) for p in prompts)
    steps = min(int(maximum_tokens), max_seq_length - width)
    use_cache = not recompute and getattr(runner, "supports_cache", True)
    device = device or torch.device("cpu")
    tokens, real = left_pad(prompts, eod, width)
    b = len(prompts)
    tokens = torch.cat([tokens, torch.full((b, steps), int(eod), dtype=torch.long)], dim=1).to(device)
    real = torch.cat([real, torch.ones((b, steps), dtype=torch.bool)], dim=1).to(device)  # generated: real
    positions = padded_position_ids(real)
    unpadded = bool(real.all())
    cache = KVCache(max_length=width + steps) if use_cache else None
    done = torch.zeros(b, dtype=torch.bool, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    step_logits: List[torch.Tensor] = []
    for step in range(steps):
        end = width + step
        start = 0 if (cache is None or step == 0) else end - 1
        # without padding the model's own causal masking applies (and its fastest attention path)
        mask = None if unpadded else padded_attention_mask(real, start, end)
        state = cache
        if not unpadded:
            # recurrent layers (Mamba, RWKV) have no mask: they learn the pad slots from the cache, and a
            # recompute forward of a model with such layers gets a fresh one (a full forward from an empty
            # state is the recompute); attention layers read the mask and ignore the padding
            if cache is None and getattr(runner, "recurrent", False) and getattr(runner, "supports_cache", True):
                state = KVCache(max_length=end)
            if state is not None:
                state.set_padding(~real[:, start:end])
        logits = runner(tokens[:, start:end], positions[:, start:end], mask, state, last_only=True)
        last = logits[:, -1].float()
        if return_logits:
            step_logits.append(last.cpu())
        if vocab_size is not None and vocab_size < last.size(-1):
            last = last.clone()
            last[:, vocab_size:] = float("-inf")
        new = sample_next(last, params, generator)
        new = torch.where(done, torch.full_like(new, eod), new)
        tokens[:, end] = new
        hit_eod = (new == eod) & ~done if stop_at_eod else torch.zeros_like(done)
        finished |= hit_eod
        lengths += (~done & ~hit_eod).long()
        done |= hit_eod
        if bool(done.all()):
            break
    duration = time.perf_counter() - started
    out = []
    for row in range(b):
        n = int(lengths[row])
        row_logits = None
        if return_logits:
            kept = n + (1 if bool(finished[row]) else 0)
            row_logits = torch.stack([s[row] for s in step_logits[:kept]]) if kept else torch.empty(0)
        out.append(Generation(prompt=prompts[row], tokens=tokens[row, width:width + n].tolist(),
                              finished=bool(finished[row]), logits=row_logits, duration_seconds=duration))
    return out


def max_sequence_length(config: ModelConfig) -> int:
    """The longest prompt + sample the model can take: seq_length, or max_position_embeddings if smaller."""
    return min(config.seq_length, config.positions)


def split_prompts(text: str, prompt_end: str) -> List[str]:
    """The prompts of an input file: ``text`` split at ``prompt_end`` ("" means a newline), blank ones
    dropped."""
    separator = prompt_end or "\n"
    return [p for p in text.split(separator) if p.strip()]


def batches(items: Sequence, size: int) -> List[Sequence]:
    size = max(int(size), 1)
    return [items[i:i + size] for i in range(0, len(items), size)]
