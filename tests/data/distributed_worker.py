"""Entry point for the 2-process gloo test: every rank builds the same GPT2Dataset and reports back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def build_dataset_on_rank(rank: int, world_size: int, workdir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    from megatron.data.gpt2_dataset import GPT2Dataset
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.data.rank_sync import build_once
    from megatron.errors import DataError

    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    try:
        prefix = f"{workdir}/corpus"
        ds = GPT2Dataset("train", prefix, np.arange(40), MMapIndexedDataset(prefix), 64, 8, seed=5)
        failure = ""
        try:
            build_once(lambda: (_ for _ in ()).throw(OSError("disk full")), lambda: False)
        except Exception as exc:  # every rank must see rank 0's failure instead of hanging
            failure = f"{type(exc).__name__}: {exc}"
        data_failure = ""
        try:  # a DataError (a read-only data directory) stays a DataError on every rank, for train.py to print
            build_once(lambda: (_ for _ in ()).throw(DataError("set data_cache_path")), lambda: False)
        except Exception as exc:
            data_failure = f"{type(exc).__name__}: {exc}"
        # Only rank 1 loads data here (as when only some model-parallel ranks do): its own group.
        loaders_only = dist.new_group([1])
        subgroup_built = None
        if rank == 1:
            sub_ds = GPT2Dataset(
                "valid", prefix, np.arange(40), MMapIndexedDataset(prefix), 16, 8, seed=5, group=loaders_only
            )
            subgroup_built = sub_ds.built_index_maps
        report = {
            "subgroup_built": subgroup_built,
            "built": ds.built_index_maps,
            "first": [ds[i]["text"].tolist() for i in range(4)],
            "failure": failure,
            "data_failure": data_failure,
        }
        Path(f"{workdir}/rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()
