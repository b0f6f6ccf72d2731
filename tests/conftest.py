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


@pytest.fixture(autouse=True)
def _attack_description(request):
    """Records what an `attack`-marked case tries, so that the account at the end of the run can name it
    (marker arguments do not travel from xdist workers; user properties do)."""
    marker = request.node.get_closest_marker("attack")
    if marker is not None:
        if not marker.args or not isinstance(marker.args[0], str):
            raise TypeError(f"{request.node.nodeid}: write @pytest.mark.attack(\"what the attack tries\")")
        request.node.user_properties.append(("attack", marker.args[0]))
    yield


def _attack_account(terminalreporter, reports) -> None:
    """The attack suite's account (issue 32): how many attacks were tried and how many the project met cleanly,
    naming every one that was not."""
    attacks = [(r, dict(getattr(r, "user_properties", [])).get("attack")) for r in reports
               if "attack" in getattr(r, "keywords", {})]
    if not attacks:
        return
    terminalreporter.write_sep("-", "attack suite")
    clean = sum(r.outcome == "passed" for r, _ in attacks)
    terminalreporter.write_line(f"{len(attacks)} attacks tried, {clean} met cleanly (no code run, no file outside the "
                                f"run touched, no checkpoint lost, no process left, one clear message)")
    for r, what in attacks:
        if r.outcome != "passed":
            terminalreporter.write_line(f"NOT CLEAN: {what or r.nodeid} ({r.nodeid})")


def pytest_terminal_summary(terminalreporter):
    """The fault suite's account (issue 19), printed at the end of the run, also from xdist workers (report
    keywords and properties travel with the reports): how many `fault`-marked cases passed and failed, and the
    counts the kill test records with record_property("suite_counts", text)."""
    reports = [r for key in ("passed", "failed", "error") for r in terminalreporter.stats.get(key, [])
               if getattr(r, "when", "call") == "call" or r.outcome != "passed"]
    _attack_account(terminalreporter, reports)
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
