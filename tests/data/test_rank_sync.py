"""Rank 0 builds the index maps while the other rank waits; single-process use needs no process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from megatron.data.rank_sync import build_once
from tests.data.dataset_factory import make_docs, write_dataset
from tests.data.distributed_worker import build_dataset_on_rank


def test_single_process_builds_once(tmp_path: Path) -> None:
    target = tmp_path / "f"
    calls = []

    def build() -> None:
        calls.append(1)
        target.write_text("x")

    assert build_once(build, target.exists) is True
    assert build_once(build, target.exists) is False
    assert calls == [1]
    with pytest.raises(RuntimeError, match="missing after the build step"):
        build_once(lambda: None, lambda: False)


@pytest.mark.slow
def test_two_gloo_ranks_share_one_build(tmp_path: Path) -> None:
    write_dataset(tmp_path / "corpus", make_docs(40))
    mp.spawn(build_dataset_on_rank, args=(2, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["built"] is True and r1["built"] is False
    assert r0["first"] == r1["first"]
    assert r0["subgroup_built"] is None and r1["subgroup_built"] is True
    assert len(list(tmp_path.glob("corpus_train_indexmap_*.npy"))) == 3
    assert len(list(tmp_path.glob("corpus_valid_indexmap_*.npy"))) == 3
    assert "disk full" in r0["failure"] and "another rank" in r1["failure"] and "disk full" in r1["failure"]
    assert r0["data_failure"] == r1["data_failure"] == "DataError: set data_cache_path"
