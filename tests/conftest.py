"""Suite-wide pytest setup: DeepSpeed's CPU accelerator where CUDA is absent (tests.accelerator), GPU tests skip
there; CPU threads are capped so that parallel processes on a 2-core machine do not oversubscribe it."""
import os

import pytest

from tests.accelerator import deepspeed_accelerator_env

os.environ.update(deepspeed_accelerator_env())
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_terminal_summary(terminalreporter):
    """The fault suite's account (issue 19), printed at the end of the run, also from xdist workers (report
    keywords and properties travel with the reports): how many `fault`-marked cases passed and failed, and the
    counts the kill test records with record_property("suite_counts", text)."""
    reports = [r for key in ("passed", "failed", "error") for r in terminalreporter.stats.get(key, [])
               if getattr(r, "when", "call") == "call" or r.outcome != "passed"]
    faults = [r for r in reports if "fault" in getattr(r, "keywords", {})]
    lines = [value for r in reports for name, value in getattr(r, "user_properties", []) if name == "suite_counts"]
    if not faults and not lines:
        return
    terminalreporter.write_sep("-", "fault suite")
    passed = sum(r.outcome == "passed" for r in faults)
    terminalreporter.write_line(f"{passed} fault cases passed, {len(faults) - passed} failed (kills mid-save and "
                                f"mid-evaluation, signals, lost ranks, damaged / missing / truncated files, a full "
                                f"disk, a read-only or locked save directory, hostile pickles and launcher values)")
    for line in lines:
        terminalreporter.write_line(line)
