#!/usr/bin/env python
"""Generation throughput: this project's KV-cache decoding (megatron/inference/text_generation.py) against
Hugging Face transformers' generate() with its KV cache, on the same weights (our randomly initialised
model converted with megatron/checkpoint_conversion), greedy, batch 1 and batch 8.

    python bench/generate_throughput.py
    python bench/generate_throughput.py --prompt 128 --new 128 --repeats 3 --size small

Contenders alternate within each repeat (the order turning). Time to first token is the time to produce
one new token for the whole batch (prefill; median of 5 x --repeats runs, at least 10); tokens/s counts
the new tokens of the whole batch over the full generation. Both stop only after --new tokens (no EOD
stop), and the greedy tokens are checked to agree."""

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_description, print_table  # noqa: E402

SIZES = {"small": {"num_layers": 6, "hidden_size": 512, "num_attention_heads": 8},
         "large": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12}}
VOCAB = 50304


def build_models(size: str, max_len: int):
    """(our sequential model, its ModelConfig, the transformers copy)."""
    from megatron.checkpoint_conversion.hf_gptneox import to_hf
    from megatron.checkpoint.neox_checkpoint import flat_state_dict
    from megatron.model.gpt2_model import build_model
    from megatron.model.config import ModelConfig
    from megatron.mpu import SingleProcessState

    config = ModelConfig(**SIZES[size], seq_length=max_len, padded_vocab_size=VOCAB, pos_emb="rotary",
                         rotary_pct=0.25, gpt_j_residual=True, no_weight_tying=True, activation="gelu", seed=1)
    ours = build_model(config, SingleProcessState()).eval()
    from transformers import GPTNeoXForCausalLM

    hf_config, state = to_hf(config, flat_state_dict(ours.state_dict(), config))
    hf = GPTNeoXForCausalLM(hf_config).eval()
    expected = set(hf.state_dict())
    # transformers 5 names the output head lm_head (4.x: embed_out, which 5.x still reads from files)
    state = {("lm_head.weight" if k == "embed_out.weight" and "lm_head.weight" in expected else k): v
             for k, v in state.items()}
    hf.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=True)
    return ours, config, hf


def timed_interleaved(fns: Dict[str, Callable[[], List[List[int]]]], repeats: int) -> Dict[str, tuple]:
    """{name: (median seconds, last output)}; each repeat runs every contender once, so that a slow
    stretch of the machine (2 shared cores) falls on all of them alike, and the order turns every repeat
    (the first of a pair measures a few % slower, whichever it is)."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    outs: Dict[str, List[List[int]]] = {}
    names = list(fns)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            fn = fns[name]
            start = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), outs[name]) for name in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from megatron.mpu import SingleProcessState
    from megatron.inference.text_generation import SequentialRunner, generate_tokens

    torch.manual_seed(0)
    max_len = args.prompt + args.new
    ours, _, hf = build_models(args.size, max_len)
    runner = SequentialRunner(ours, SingleProcessState())
    rows = []
    for batch in (1, 8):
        prompts = torch.randint(1, VOCAB, (batch, args.prompt))

        def run_ours(new: int) -> List[List[int]]:
            out = generate_tokens(runner, prompts.tolist(), eod=0, maximum_tokens=new, max_seq_length=max_len,
                                  stop_at_eod=False, vocab_size=VOCAB)
            return [g.tokens for g in out]

        @torch.no_grad()
        def run_hf(new: int) -> List[List[int]]:
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
            return out[:, args.prompt:].tolist()

        contenders = {"ours": run_ours, "hf": run_hf}
        # one prefill is short and noisy on shared cores: many more repeats than the full generation
        first = timed_interleaved({name: (lambda fn=fn: fn(1)) for name, fn in contenders.items()},
                                  max(10, 5 * args.repeats))
        full = timed_interleaved({name: (lambda fn=fn: fn(args.new)) for name, fn in contenders.items()},
                                 args.repeats)
        results = {name: (first[name][0], full[name][0], full[name][1]) for name in contenders}
        agree = results["ours"][2] == results["hf"][2]
        for name, label in (("ours", "(a) this project, KV cache"), ("hf", "(b) transformers generate()")):
            ttft, total, _ = results[name]
            ratio = results["hf"][1] / total
            rows.append([label, str(batch), f"{batch * args.new / total:,.1f}", f"{ttft * 1000:.0f}",
                         f"{ratio:.2f}", "yes" if agree else "NO"])
    shape = SIZES[args.size]
    print_table(f"Generation throughput: {args.size} ({shape['num_layers']} layers, hidden {shape['hidden_size']}, "
                f"vocab {VOCAB}), prompt {args.prompt} + {args.new} new tokens, greedy, fp32, on "
                f"{machine_description()}",
                ["contender", "batch", "new tokens/s", "time to first token ms", "speed vs (b)",
                 "same greedy tokens"], rows)


if __name__ == "__main__":
    main()
