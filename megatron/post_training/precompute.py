"""Reference log-probabilities computed once, before DPO (generate.py with text_gen_type 'precompute'), instead
of by a reference model running beside the policy during training.

For each pairwise data path P (pos_* and neg_* of every split) it writes the float32 indexed dataset
`P_{precompute_model_name}` (GPT-NeoX's name): per sequence, value j is log p(token j | tokens before j) under
the loaded model (0 for the first token; at most seq_length + 1 values, as training reads no more). With
`precompute_model_name` set, DPO training reads these files (PairwiseDataset's pos_ref / neg_ref) and sums them
over the label positions, the sum the reference model would have computed (in fp32).
"""

from __future__ import annotations

import os
from typing import Any, List

import numpy as np
import torch

from megatron.mpu import vocab_parallel_cross_entropy


def precomputed_path(data_prefix: str, model_name: str) -> str:
    return f"{data_prefix}_{model_name}"


def pairwise_paths(neox_args: Any) -> List[str]:
    """Every pos_* / neg_* data path of the config, train then valid then test."""
    out: List[str] = []
    for split in ("train", "valid", "test"):
        for kind in ("pos", "neg"):
            value = getattr(neox_args, f"{kind}_{split}_data_paths") or []
            out += [value] if isinstance(value, str) else list(value)
    return out


@torch.no_grad()
def token_logps(model: torch.nn.Module, samples: torch.Tensor, group=None) -> torch.Tensor:
    """[rows, n] float32 log p(token j | tokens before j) (0 at j = 0 and at -100 padding) of [rows, n] samples."""
    from megatron.model.batch import masks_and_position_ids

    inputs, targets = samples[:, :-1].clamp(min=0), samples[:, 1:]
    mask, _, positions = masks_and_position_ids(inputs, None, False)
    logps = -vocab_parallel_cross_entropy(model((inputs, positions, mask)), targets.clamp(min=0), group).float()
    logps = logps.masked_fill(targets < 0, 0.0)
    return torch.cat([torch.zeros_like(logps[:, :1]), logps], dim=1)


def precompute_reference_logps(neox_args: Any, model: torch.nn.Module, ctx: Any) -> List[str]:
    """Write `P_{precompute_model_name}` for every pairwise data path P (existing files are kept); returns the
    files written. Every rank computes (tensor-parallel ranks need the same batches); global rank 0 writes."""
    import torch.distributed as dist

    from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, dataset_exists

    model = model.to_sequential() if hasattr(model, "to_sequential") else model
    model.eval()
    writes = not dist.is_initialized() or dist.get_rank() == 0
    limit, batch = int(neox_args.seq_length) + 1, int(neox_args.train_micro_batch_size_per_gpu or 1)
    group = ctx.parallel_state.get_model_parallel_group()
    written = []
    for prefix in pairwise_paths(neox_args):
        out = precomputed_path(prefix, neox_args.precompute_model_name)
        if dataset_exists(out):
            continue
        data = MMapIndexedDataset(prefix)
        builder = MMapIndexedDatasetBuilder(out, np.float32) if writes else None
        for start in range(0, len(data), batch):
            seqs = [data.get(i, 0, min(int(data.sizes[i]), limit)) for i in range(start, min(start + batch, len(data)))]
            samples = torch.full((len(seqs), limit), -100, dtype=torch.long)
            for row, seq in enumerate(seqs):
                samples[row, : len(seq)] = torch.as_tensor(seq.astype(np.int64))
            logps = token_logps(model, samples.to(ctx.device), group).cpu().numpy()
            if builder is not None:
                for row, seq in enumerate(seqs):
                    builder.add_item(logps[row, : len(seq)])
                    builder.end_document()
        if builder is not None:
            builder.finalize()
            print(f"precomputed reference log-probabilities of {prefix}: {out}.bin/.idx", flush=True)
        written.append(out)
    if dist.is_initialized():
        dist.barrier()
    return written
