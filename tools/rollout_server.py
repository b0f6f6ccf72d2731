#!/usr/bin/env python
"""Serve rollouts to an online REINFORCE run (train_impl: reinforce, dataset_impl: online): sample completions of
prompts from the newest checkpoint in the run's save directory (loaded again when `latest` moves), score them with
your reward function, and answer over GPT-NeoX's online-data protocol (a GPT-NeoX trainer can use it too).

    python tools/rollout_server.py --save checkpoints/reinforce --reward my_rewards:score --port 10000

--reward names a Python function as module:function (importable from the current directory or PYTHONPATH): it is
code you chose, run in this process. It is called with two lists of strings, (prompts, completions), one pair per
completion, and returns one number per completion. --prompts is a text file with one prompt per line (without it
every completion starts from the end-of-document token). Set the run's online_dataserver_ips / _ports to --host /
--port. See docs/post-training.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.errors import CheckpointError, ConfigError, ConversionError, TokenizerError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", required=True, help="the training run's save directory (its `latest` is followed)")
    p.add_argument("--reward", required=True, help="the reward function, module:function")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (online_dataserver_ips)")
    p.add_argument("--port", type=int, default=10000, help="port to listen on (online_dataserver_ports)")
    p.add_argument("--prompts", help="text file, one prompt per line (default: unconditional samples)")
    p.add_argument("--prompts-per-request", type=int, default=8)
    p.add_argument("--completions-per-prompt", type=int, default=4,
                   help="completions sampled per prompt (reinforce_leave_one_out compares them)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cpu", help="cpu, or cuda to sample on the GPU")
    p.add_argument("--tokenizer-type", help="default: the checkpoint's")
    p.add_argument("--vocab-file", help="default: the checkpoint's")
    p.add_argument("--merge-file", help="default: the checkpoint's")
    p.add_argument("--max-requests", type=int, help="exit after answering this many requests (default: never)")
    return p.parse_args(argv)


def read_prompts(path: str | None) -> list[str]:
    if not path:
        return []
    if not os.path.isfile(path):
        raise ConfigError([f"--prompts {path!r}: no such file (one prompt per line)"])
    with open(path, encoding="utf-8") as handle:
        prompts = [line.rstrip("\n") for line in handle if line.strip()]
    if not prompts:
        raise ConfigError([f"--prompts {path!r} holds no prompts"])
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron.inference.text_generation import GenerationError, SamplingParams
    from megatron.post_training.rollout_server import (Policy, RolloutMaker, RolloutSettings, listening_socket,
                                                       load_reward, serve)

    sys.path.insert(0, os.getcwd())  # the reward module may sit beside the user's configs
    try:
        for flag in ("prompts_per_request", "completions_per_prompt", "max_new_tokens"):
            if getattr(args, flag) < 1:
                raise ConfigError([f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}"])
        reward = load_reward(args.reward)
        settings = RolloutSettings(args.prompts_per_request, args.completions_per_prompt, args.max_new_tokens,
                                   SamplingParams(args.temperature, args.top_k, args.top_p), args.seed)
        policy = Policy(args.save, args.device, {"tokenizer_type": args.tokenizer_type,
                                                 "vocab_file": args.vocab_file, "merge_file": args.merge_file})
        maker = RolloutMaker(policy, reward, args.reward, read_prompts(args.prompts), settings)
        server = listening_socket(args.host, args.port)
        print(f"rollout server: listening on {args.host}:{args.port}, following {args.save}", flush=True)
        with server:
            serve(server, maker, say=lambda line: print(line, flush=True), max_requests=args.max_requests)
    except (ConfigError, CheckpointError, ConversionError, TokenizerError, GenerationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
