"""Suite-wide pytest setup: GPU tests skip where CUDA is absent; CPU threads are capped so that
parallel processes on a 2-core machine do not oversubscribe it."""
import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
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
    """Counts a test reports with record_property("suite_counts", text) (the fault suite's), printed at the end
    of the run, also from xdist workers (report properties travel with the reports)."""
    lines = [value for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
             for name, value in getattr(report, "user_properties", []) if name == "suite_counts"]
    if lines:
        terminalreporter.write_sep("-", "fault suite")
        for line in lines:
            terminalreporter.write_line(line)
