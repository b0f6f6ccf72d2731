#!/usr/bin/env python
"""Mamba and RWKV layers against attention layers of the same depth and width, in this project:

* training through deepy.py train.py (as bench/train_throughput.py: random tokens, the median step time
  after --warmup steps, the peak resident memory of the process tree, or peak GPU memory on a GPU);
* greedy decoding after a long prompt with the KV cache (in process, batch 1): the median time of one new
  token after a prompt of --context tokens, and the size of the decoding state (attention keeps keys and
  values for every position, a recurrent layer a fixed state).

    python bench/recurrent_throughput.py                       # 4 layers, hidden 256, seq 512
    python bench/recurrent_throughput.py --context 4096 --new 32 --repeats 3

Attention layers are GPT-NeoX's global attention with rotary embeddings; Mamba and RWKV stacks use no
position embeddings (as their configs in configs/mamba, configs/rwkv). Same layers, hidden size, vocabulary,
batch, sequence length and data for all three; their parameter counts differ (listed)."""

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (machine_description, median, plain_train_config, print_table,  # noqa: E402
                          step_time_and_peak, train_with_deepy)
from bench.train_throughput import write_data  # noqa: E402

SIZES = {"tiny": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},     # smoke test of the script
         "small": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4},
         "medium": {"num_layers": 6, "hidden_size": 512, "num_attention_heads": 8}}
VOCAB = 50304
LAYERS = {"attention": {"pos_emb": "rotary", "attention_config": [[["global"], "all"]]},
          "mamba": {"pos_emb": "none", "attention_config": [[["mamba"], "all"]]},
          "rwkv": {"pos_emb": "none", "attention_config": [[["rwkv"], "all"]]}}


def train_config(args, kind: str, data: Dict[str, str], directory: str) -> Dict:
    """The deepy.py config of one contender."""
    return {**plain_train_config(SIZES[args.size], args.seq, args.batch, args.warmup + args.steps, data, directory),
            **LAYERS[kind]}


def train(args, kind: str, data: Dict[str, str], directory: str) -> Dict:
    records, result = train_with_deepy(train_config(args, kind, data, directory), directory, kind, args.port)
    return step_time_and_peak(records, result, args.warmup)


def decode(args, kind: str) -> Dict:
    """Median seconds per new token after a --context-token prompt, the decoding state's size, the
    parameter count (in process, batch 1, greedy)."""
    import torch

    from megatron.model.kv_cache import KVCache
    from megatron.model.gpt2_model import build_model
    from megatron.model.config import ModelConfig
    from megatron.mpu import SingleProcessState

    length = args.context + args.new
    layers = SIZES[args.size]["num_layers"]
    attention_config = [[[LAYERS[kind]["attention_config"][0][0][0]], layers]]
    config = ModelConfig(**SIZES[args.size], seq_length=length, padded_vocab_size=VOCAB,
                         pos_emb=LAYERS[kind]["pos_emb"], attention_config=attention_config, no_weight_tying=True,
                         seed=1)
    model = build_model(config, SingleProcessState()).eval()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    prompt = torch.randint(1, VOCAB, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    steps: List[float] = []
    state_bytes = 0
    with torch.no_grad():
        for _ in range(args.repeats):
            cache = KVCache(max_length=length)
            logits = model((prompt, torch.arange(args.context, device=device).unsqueeze(0), None), kv_cache=cache,
                           logits_to_keep=1)
            token = logits[:, -1:].argmax(-1)
            for _ in range(args.new):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                position = torch.full_like(token, cache.length)
                token = model((token, position, None), kv_cache=cache)[:, -1:].argmax(-1)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                steps.append(time.perf_counter() - start)
            tensors = [t for pair in cache._kv.values() for t in pair] + \
                [t for state in cache._recurrent.values() for t in state]
            state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return {"token_time": statistics.median(steps), "state_mb": state_bytes / 2 ** 20,
            "params": sum(p.numel() for p in model.parameters())}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens before decoding")
    parser.add_argument("--new", type=int, default=16, help="new tokens timed per repeat")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--only", default="attention,mamba,rwkv")
    parser.add_argument("--port", type=int, default=29733)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    kinds = [k for k in LAYERS if k in args.only.split(",")]
    training: Dict[str, List[Dict]] = {k: [] for k in kinds}
    tokens_per_step = args.batch * args.seq
    with tempfile.TemporaryDirectory() as directory:
        data = write_data(directory, tokens_per_step * (args.warmup + args.steps + 2) * 2)
        for repeat in range(args.repeats):
            turn = repeat % len(kinds)
            for kind in kinds[turn:] + kinds[:turn]:
                training[kind].append(train(args, kind, data, directory))
                print(f"run {repeat + 1}/{args.repeats} {kind}: step {training[kind][-1]['step_time']:.3f}s",
                      flush=True)
    decoding = {kind: decode(args, kind) for kind in kinds}
    base = "attention" if "attention" in kinds else kinds[0]
    base_train = median([r["step_time"] for r in training[base]])
    rows = []
    for kind in kinds:
        step = median([r["step_time"] for r in training[kind]])
        peak = median([r["peak_mb"] for r in training[kind]])
        d = decoding[kind]
        rows.append([kind, f"{d['params'] / 1e6:.1f}M", f"{tokens_per_step / step:,.0f}", f"{peak:,.0f}",
                     f"{base_train / step:.2f}", f"{1 / d['token_time']:,.1f}",
                     f"{decoding[base]['token_time'] / d['token_time']:.2f}", f"{d['state_mb']:,.2f}"])
    shape = SIZES[args.size]
    print_table(f"Recurrent layers: {args.size} ({shape['num_layers']} layers, hidden {shape['hidden_size']}, vocab "
                f"{VOCAB}), training seq {args.seq} batch {args.batch}, decoding after {args.context} tokens, fp32, "
                f"on {machine_description()}",
                ["layers", "params", "train tokens/s", "train peak MB", f"train speed vs {base}",
                 f"decode tokens/s @{args.context}", f"decode speed vs {base}", "decode state MB"], rows)


if __name__ == "__main__":
    main()
