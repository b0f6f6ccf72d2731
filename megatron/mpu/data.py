"""Broadcast of a batch inside the model-parallel group.

Only the first rank of each tensor-parallel group reads data; the other ranks receive the same tensors
so that every rank of the group computes on identical inputs. Sizes travel first, then one flat buffer.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron.mpu.deepspeed_comm import collectives
from megatron.mpu.host_collectives import communication_device


def broadcast_data(keys: List[str], data: Optional[Dict[str, torch.Tensor]], dtype: torch.dtype,
                   parallel_state) -> Dict[str, torch.Tensor]:
    """Return ``{key: tensor}`` on every rank of the model-parallel group, as held by its first rank.

    ``data`` is only read on the source rank (model-parallel rank 0); other ranks may pass ``None``.
    Every tensor is cast to ``dtype``; results live on the group's communication device (the CPU with gloo,
    the current CUDA device with NCCL).
    """
    world = parallel_state.get_model_parallel_world_size()
    is_src = parallel_state.get_model_parallel_rank() == 0
    if world == 1:
        if data is None:
            raise ValueError("broadcast_data needs data on the source rank")
        return {key: data[key].to(dtype) for key in keys}
    group = parallel_state.get_model_parallel_group()
    src = parallel_state.get_model_parallel_src_rank()
    device = communication_device(group)  # NCCL moves CUDA tensors only, gloo CPU tensors
    max_dims = 8
    sizes = torch.zeros(len(keys), max_dims, dtype=torch.long, device=device)
    if is_src:
        if data is None:
            raise ValueError("broadcast_data needs data on the source rank")
        for i, key in enumerate(keys):
            shape = data[key].shape
            if len(shape) > max_dims:
                raise ValueError(f"broadcast_data supports at most {max_dims} dims, {key!r} has {len(shape)}")
            sizes[i, : len(shape)] = torch.tensor(shape, dtype=torch.long)
            sizes[i, len(shape):] = -1
    collectives().broadcast(sizes, src=src, group=group)
    shapes = [tuple(int(d) for d in row if d >= 0) for row in sizes.tolist()]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if is_src:
        flat = torch.cat([data[key].to(device=device, dtype=dtype).reshape(-1) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
    collectives().broadcast(flat, src=src, group=group)
    out, offset = {}, 0
    for key, shape, numel in zip(keys, shapes, numels):
        out[key] = flat[offset: offset + numel].view(shape)
        offset += numel
    return out
