"""Reference log-probabilities computed once, before DPO or KTO (generate.py with text_gen_type 'precompute'),
instead of by a reference model running beside the policy during training.

For each data path P of the run (pos_* and neg_* of every split for pairwise DPO data; the {train,valid,test}
data paths of KTO) it writes the float32 indexed dataset `P_{precompute_model_name}` (GPT-NeoX's name): per
sequence, value j is log p(token j | tokens before j) under the loaded model (0 for the first token; at most
seq_length + 1 values, as training reads no more). With `precompute_model_name` set, DPO and KTO training read
these files (PairwiseDataset's pos_ref / neg_ref, GPT2Dataset's ref) and sum them over the label positions, the
sum the reference model would have computed (in fp32).

Any tensor / pipeline split computes them: with pipe_parallel_size >= 2 each batch runs through DeepSpeed's
pipeline engine (the last stage's logits are sent to every stage, megatron.inference.text_generation.PipelineRunner),
and the files are the same as with one stage.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, dataset_exists
from megatron.inference.text_generation import build_runner
from megatron.model.batch import masks_and_position_ids
from megatron.model.gpt2_model import GPT2ModelPipe
from megatron.mpu import vocab_parallel_cross_entropy
from megatron.mpu.host_collectives import barrier
from megatron.post_training.data_paths import precomputed_path, reference_paths

Logits = Callable[[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]], torch.Tensor]


def logits_function(engine: Any, ctx: Any) -> Tuple[Logits, Any]:
    """(inputs -> logits, the tensor-parallel group the logits' vocabulary is split over, or None) for the model
    as setup_for_inference returns it: a sequential model's own vocabulary shard, or under a pipeline of 2+
    stages the whole vocabulary's logits on every rank (PipelineRunner)."""
    module = getattr(engine, "module", engine)
    if isinstance(module, GPT2ModelPipe) and module.num_stages > 1:
        runner = build_runner(engine, ctx.parallel_state, ctx.model_config)
        return (lambda inputs: runner(*inputs)), None
    model = module.to_sequential() if hasattr(module, "to_sequential") else module
    model.eval()
    return model, ctx.parallel_state.get_model_parallel_group()


@torch.no_grad()
def token_logps(model: Logits, samples: torch.Tensor, group=None) -> torch.Tensor:
    """[rows, n] float32 log p(token j | tokens before j) (0 at j = 0 and at -100 padding) of [rows, n] samples;
    `model` maps (tokens, position_ids, attention_mask) to logits split over `group`'s vocabulary shards."""
    inputs, targets = samples[:, :-1].clamp(min=0), samples[:, 1:]
    mask, _, positions = masks_and_position_ids(inputs, None, False)
    logits = model((inputs, positions, mask)).float()
    logps = -vocab_parallel_cross_entropy(logits, targets.clamp(min=0), group).float()
    logps = logps.masked_fill(targets < 0, 0.0)
    return torch.cat([torch.zeros_like(logps[:, :1]), logps], dim=1)


def precompute_reference_logps(neox_args: Any, model: torch.nn.Module, ctx: Any) -> List[str]:
    """Write `P_{precompute_model_name}` for every data path P of `reference_paths` (existing files are kept);
    returns the files written. Every rank computes (tensor- and pipeline-parallel ranks need the same batches);
    global rank 0 writes. `model`: the engine or module setup_for_inference returns."""
    forward, group = logits_function(model, ctx)
    writes = not dist.is_initialized() or dist.get_rank() == 0
    limit, batch = int(neox_args.seq_length) + 1, int(neox_args.train_micro_batch_size_per_gpu or 1)
    written = []
    for prefix in reference_paths(neox_args):
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
            logps = token_logps(forward, samples.to(ctx.device), group).cpu().numpy()
            if builder is not None:
                for row, seq in enumerate(seqs):
                    builder.add_item(logps[row, : len(seq)])
                    builder.end_document()
        if builder is not None:
            builder.finalize()
            print(f"precomputed reference log-probabilities of {prefix}: {out}.bin/.idx", flush=True)
        written.append(out)
    barrier()
    return written
