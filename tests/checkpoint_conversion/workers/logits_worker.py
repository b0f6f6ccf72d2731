"""deepy.py worker: load a checkpoint as generate.py and eval.py do (megatron.inference.loading.setup_for_inference)
and write the full logits of fixed tokens.

Environment: CONVERT_TOKENS (a torch file with a [batch, seq] LongTensor), CONVERT_LOGITS_OUT (where the
first rank writes the [batch, seq, padded_vocab] logits). Tensor-parallel vocabulary shards are gathered;
with a pipeline each stage runs its layers and sends the hidden states to the next stage.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from megatron.errors import CheckpointError, ConfigError, TokenizerError  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402


def _gather_vocab(logits: torch.Tensor, ps) -> torch.Tensor:
    if ps.get_model_parallel_world_size() == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(ps.get_model_parallel_world_size())]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _pipeline_logits(module, inputs, ps, hidden_size: int):
    """Run this stage's layers; returns the logits on the last stage, None elsewhere."""
    stage, stages = ps.get_pipe_parallel_rank(), ps.get_pipe_parallel_world_size()
    ranks = ps.group_ranks("pipe")
    tokens, pos, mask = inputs
    if stage == 0:
        out = module(inputs)
    else:
        hidden = torch.empty(tokens.size(0), tokens.size(1), hidden_size)
        dist.recv(hidden, src=ranks[stage - 1])
        out = module((hidden, mask))
    if stage < stages - 1:
        dist.send(out[0].contiguous(), dst=ranks[stage + 1])
        return None
    return out


def main() -> int:
    from megatron.inference.loading import setup_for_inference
    from megatron.model.batch import masks_and_position_ids

    try:
        args = NeoXArgs.consume_neox_args()
        engine, ctx, _ = setup_for_inference(args)
    except (ConfigError, CheckpointError, TokenizerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokens = torch.load(os.environ["CONVERT_TOKENS"])
    mask, _, pos = masks_and_position_ids(tokens, None, False)
    ps = ctx.parallel_state
    module = getattr(engine, "module", engine)  # the PipelineEngine's module, or the model itself
    with torch.no_grad():
        if args.is_pipe_parallel:
            logits = _pipeline_logits(module, (tokens, pos, mask), ps, args.hidden_size)
        else:
            logits = module((tokens, pos, mask))
        if logits is not None:
            logits = _gather_vocab(logits.float(), ps)
            if ps.get_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                torch.save(logits, os.environ["CONVERT_LOGITS_OUT"])
    ctx.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
