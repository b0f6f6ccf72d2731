"""merge_datasets.py concatenates datasets in order and refuses mismatched dtypes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.data.dataset_factory import make_docs, write_dataset
from tests.tools.tool_runner import load_tool


def test_merge_dir_and_list(tmp_path: Path, capsys) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    parts = [make_docs(5, seed=k) for k in range(3)]
    for k, docs in enumerate(parts):
        write_dataset(shards / f"s{k}", docs)
    tool = load_tool("tools/datasets/merge_datasets.py")
    assert tool.main(["--input-dir", str(shards), "--output-prefix", str(tmp_path / "all")]) == 0
    merged = MMapIndexedDataset(tmp_path / "all")
    expected = [d for docs in parts for d in docs]
    assert [merged.document(i).tolist() for i in range(merged.num_documents)] == [d.tolist() for d in expected]
    assert "15 documents" in capsys.readouterr().out
    write_dataset(tmp_path / "wide", make_docs(2), dtype=np.int64)
    assert (
        tool.main(["--inputs", str(shards / "s0"), str(tmp_path / "wide"), "--output-prefix", str(tmp_path / "x")]) == 2
    )
    assert "cannot merge datasets of different dtypes" in capsys.readouterr().err
    assert not (tmp_path / "x.bin").exists()
