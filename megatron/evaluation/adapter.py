"""Our model as an lm-evaluation-harness (0.4.x) language model.

``NeoXLM`` subclasses lm-eval's TemplateLM (itself an ``lm_eval.api.model.LM``) so that contexts and
continuations are tokenised exactly as lm-eval's own Hugging Face model does (same split of trailing
spaces, same end-of-text prefix for an empty context, same rolling windows), which is what makes the
scores of the two comparable number for number.

* loglikelihood: requests are sorted longest first and run in batches of ``batch_size``, right-padded
  (causal attention: padding after a sequence never changes its logits); a sequence longer than
  ``max_length`` keeps its last ``max_length`` tokens (the context is truncated from the left).
* loglikelihood_rolling: lm-eval's disjoint rolling windows of ``max_length`` tokens.
* generate_until: batched left-padded decoding (megatron.inference.text_generation), greedy unless the task
  asks for sampling, the context truncated from the left to leave room for max_gen_toks, the text cut at
  the end-of-text token and the first stop string. As in lm-eval's hf model, every id of the (padded)
  output layer may be drawn.

Data parallelism: ``rank`` / ``world_size`` are the data-parallel rank and size, so lm-eval's evaluator
gives each model replica its share of the documents and gathers the metrics through ``all_gather`` /
``gather_object`` / ``barrier`` below (over the data-parallel group). The tensor- and pipeline-parallel
ranks of a replica see the same requests and run the model together. With pipe_parallel_size > 1 every
forward (DeepSpeed's eval_batch) is a collective of the whole world, so replicas cannot run different
documents: there every replica evaluates all documents (rank 0, world size 1 to lm-eval).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from megatron.inference.text_generation import ModelRunner, PipelineRunner, SamplingParams, generate_tokens
from megatron.model.batch import causal_only_mask
from megatron.mpu import host_collectives

DEFAULT_MAX_GEN_TOKS = 256


class NeoXLM(TemplateLM):
    """lm-eval LM over a ModelRunner (full-vocabulary logits on every rank) and our tokenizer."""

    def __init__(self, runner: ModelRunner, tokenizer, parallel_state, max_length: int, batch_size: int,
                 device: torch.device, seed: int = 1234) -> None:
        super().__init__()
        self.runner = runner
        self.neox_tokenizer = tokenizer
        self.ps = parallel_state
        self._max_length = int(max_length)
        self.batch_size = max(int(batch_size), 1)
        self._device = device
        shard = not isinstance(runner, PipelineRunner)
        self._rank = parallel_state.get_data_parallel_rank() if shard else 0
        self._world_size = parallel_state.get_data_parallel_world_size() if shard else 1
        self._dp_group = parallel_state.get_data_parallel_group() if self._world_size > 1 else None
        self.seed = int(seed)

    # ---- what TemplateLM needs ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.neox_tokenizer.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.neox_tokenizer, "name", type(self.neox_tokenizer).__name__))

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        return list(self.neox_tokenizer.tokenize(string))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.neox_tokenizer.detokenize(list(tokens))

    # ---- scoring ------------------------------------------------------------------------------
    def _score(self, rows: List[Tuple[List[int], int]]) -> List[Tuple[float, bool]]:
        """(sum of log-probabilities, all greedy) of the last ``n`` tokens of each token list, where the
        model sees all but the last token; ``rows`` is [(tokens, n)], already within max_length + 1."""
        inputs = [tokens[:-1] for tokens, _ in rows]
        width = max(len(x) for x in inputs)
        batch = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
        for i, x in enumerate(inputs):
            batch[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        batch = batch.to(self._device)
        positions = torch.arange(width, device=self._device).unsqueeze(0).expand(len(rows), width)
        logprobs = F.log_softmax(self.runner(batch, positions, causal_only_mask(self._device)).float(), dim=-1)
        answers = []
        for i, (tokens, n) in enumerate(rows):
            length = len(inputs[i])
            target = torch.tensor(tokens[-n:], dtype=torch.long, device=self._device)
            scores = logprobs[i, length - n:length]
            picked = scores.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            answers.append((float(picked.sum()), bool(torch.equal(scores.argmax(-1), target))))
        return answers

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        """requests: [((context, continuation) or None, context_ids, continuation_ids)]."""
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval sent a loglikelihood request with an empty continuation")
            tokens = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((tokens, min(len(continuation), len(tokens) - 1)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: Dict[int, Tuple[float, bool]] = {}
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            for i, answer in zip(chunk, self._score([rows[i] for i in chunk])):
                results[i] = answer
        out = [results[i] for i in range(len(rows))]
        for (pair, _, _), answer in zip(requests, out):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        windows: List[Tuple[int, Tuple[Any, List[int], List[int]]]] = []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((index, (None,) + tuple(window)))
        scores = self._loglikelihood_tokens([w for _, w in windows])
        totals = [0.0] * len(requests)
        for (index, _), (logprob, _) in zip(windows, scores):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation ---------------------------------------------------------------------------
    @staticmethod
    def _sampling(kwargs: Dict[str, Any]) -> SamplingParams:
        if not kwargs.get("do_sample", False):
            return SamplingParams()
        temperature = float(kwargs.get("temperature", 1.0) or 0.0)
        return SamplingParams(temperature=temperature, top_k=int(kwargs.get("top_k", 0) or 0),
                              top_p=float(kwargs.get("top_p", 0.0) or 0.0))

    @staticmethod
    def _stops(kwargs: Dict[str, Any]) -> List[str]:
        until = kwargs.get("until", [])
        return [until] if isinstance(until, str) else list(until or [])

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        groups: Dict[str, List[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items(), key=lambda kv: kv[0])), []).append(i)
        outputs: Dict[int, str] = {}
        generator = torch.Generator(device=self._device).manual_seed(self.seed)
        batches = []
        for indices in groups.values():
            indices = sorted(indices, key=lambda i: -len(requests[i].args[0]))
            batches += [indices[i:i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        for indices in batches:
            kwargs = dict(requests[indices[0]].args[1])
            texts = self._generate([requests[i].args[0] for i in indices], kwargs, generator)
            for i, text in zip(indices, texts):
                outputs[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return [outputs[i] for i in range(len(requests))]

    def _generate(self, contexts: List[str], kwargs: Dict[str, Any], generator: torch.Generator) -> List[str]:
        max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        max_new = max(1, min(max_new, self.max_length - 1))
        keep = self.max_length - max_new
        prompts = [(self.tok_encode(c) or [self.eot_token_id])[-keep:] for c in contexts]
        results = generate_tokens(self.runner, prompts, eod=self.eot_token_id, maximum_tokens=max_new,
                                  max_seq_length=self.max_length, params=self._sampling(kwargs),
                                  generator=generator, device=self._device)
        stops = self._stops(kwargs)
        texts = []
        for result in results:
            tokens = result.tokens
            if self.eot_token_id in tokens:
                tokens = tokens[:tokens.index(self.eot_token_id)]
            text = self.tok_decode(tokens)
            for stop in stops:
                if stop:
                    text = text.split(stop)[0]
            texts.append(text)
        return texts

    # ---- data-parallel communication for lm-eval's evaluator ----------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._dp_group is None:
            return tensor.reshape(-1)
        return host_collectives.all_gather(tensor.reshape(-1), group=self._dp_group)

    def gather_object(self, obj, dst: int = 0):
        if self._dp_group is None:
            return [obj]
        parts = host_collectives.all_gather_object(obj, group=self._dp_group)
        return parts if self._rank == dst else None

    def barrier(self) -> None:
        if self._dp_group is not None:
            host_collectives.barrier(group=self._dp_group)
