"""Analyse the difficulty of every training sample a config builds, for DeepSpeed's curriculum sampling
(data_efficiency.data_sampling, docs/training.md), with DeepSpeed's DataAnalyzer.

    python tools/datasets/analyze_difficulty.py configs/125M.yml configs/local_setup.yml \
        --metrics seqlen vocab_rarity --save-path data/difficulty

Give it the same config files as the training run: the samples are that run's training split (its data, split,
seq_length, seed and length decide them). For each metric it writes DeepSpeed's analysis files under
<save-path>/<metric>/ and prints the paths to put in curriculum_metrics (megatron.data.difficulty).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.data.data_efficiency import METRICS  # noqa: E402
from megatron.data.data_utils import build_train_valid_test_datasets  # noqa: E402
from megatron.data.difficulty import analyze  # noqa: E402
from megatron.errors import ConfigError, DataError, TokenizerError  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402
from megatron.training_schedule import TrainingSchedule  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", help="the training run's YAML config files")
    p.add_argument("--metrics", nargs="+", default=["vocab_rarity"], choices=sorted(METRICS),
                   help="difficulty metrics: " + "; ".join(f"{k}: {v}" for k, v in METRICS.items()))
    p.add_argument("--save-path", required=True, help="directory for the analysis files")
    p.add_argument("--batch-size", type=int, default=64, help="samples per analysis batch")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        neox_args = NeoXArgs.from_ymls(args.configs)
        train, _, _ = build_train_valid_test_datasets(neox_args, TrainingSchedule.from_neox_args(neox_args)
                                                      .split_samples())
        vocab_size = build_tokenizer(neox_args).vocab_size
        paths = analyze(train, args.metrics, args.save_path, vocab_size, args.batch_size)
    except (ConfigError, DataError, TokenizerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"analysed {len(train)} training samples; curriculum_metrics paths:")
    print(json.dumps(paths, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
