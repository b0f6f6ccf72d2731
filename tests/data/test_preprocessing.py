"""encode_documents: several worker processes share the batches and the output keeps input order."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

from megatron.errors import DataError
from megatron.data.preprocessing import encode_documents


@dataclass(frozen=True)
class PidEncoderSpec:
    """Encodes a document as [its number, the pid of the process that encoded it]."""

    fail_on: int = -1

    def output_dtypes(self) -> dict[str, type]:
        return {"text_document": np.int64}

    def build(self):
        def encode(docs):
            if any(int(d["text"]) == self.fail_on for d in docs):
                raise ValueError(f"cannot encode document {self.fail_on}")
            return [{"text_document": np.array([int(d["text"]), os.getpid()])} for d in docs]

        return encode


def test_two_workers_share_the_work_in_order() -> None:
    docs = [{"text": str(i)} for i in range(400)]
    out = list(encode_documents(iter(docs), PidEncoderSpec(), workers=2, batch_size=5))
    assert [int(o["text_document"][0]) for o in out] == list(range(400))
    pids = {int(o["text_document"][1]) for o in out}
    assert len(pids) == 2 and os.getpid() not in pids
    in_process = list(encode_documents(iter(docs[:7]), PidEncoderSpec(), workers=1, batch_size=3))
    assert {int(o["text_document"][1]) for o in in_process} == {os.getpid()}


def test_worker_failure_is_reported_not_hung() -> None:
    docs = [{"text": str(i)} for i in range(100)]
    with pytest.raises(DataError, match="worker failed: ValueError: cannot encode document 42"):
        list(encode_documents(iter(docs), PidEncoderSpec(fail_on=42), workers=2, batch_size=4))
    with pytest.raises(DataError, match="--workers must be >= 1"):
        list(encode_documents(iter(docs), PidEncoderSpec(), workers=0))
