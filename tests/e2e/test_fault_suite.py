"""The fault suite (issue 19): a 2-rank ZeRO-1 job killed with SIGKILL at 20 random moments (mid-save, between
COMPLETE and `latest`, mid-evaluation, at a random time) and resumed after each, against the same job run straight
through; half the killed segments save with async_save (issue 17), and those can also be killed while rank 0's
background writer is writing a file; then one rank killed alone, and one rank hung. tests/e2e/workers/fault_driver.py does it; this test checks
its counts and prints them at the end of the run. The seed is random each run (NEOX_FAULT_SEED repeats one).

The other faults have their own tests: a full disk, damaged files and a read-only save directory
(tests/checkpoint/test_integrity.py, tests/e2e/test_prelaunch.py), concurrent writers (tests/checkpoint/test_run_lock.py),
a hostile pickle (tests/checkpoint/test_files.py), hostile launcher values (tests/neox_arguments/test_launcher.py)."""

import json
import os
import random
import subprocess
import sys

import pytest
import yaml

from tests.e2e.launch import REPO, deepy_environment
from tests.e2e.training_run import TINY_MODEL, build_tiny_corpus

pytestmark = [pytest.mark.slow, pytest.mark.fault]


def test_kills_at_twenty_random_moments_lose_nothing_and_resume_exactly(tmp_path, record_property):
    # from the OS: the module-level generator is seeded by the tests that ran before in this process
    seed = int(os.environ.get("NEOX_FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
    data = build_tiny_corpus(tmp_path / "corpus")
    config = tmp_path / "faults.yml"
    config.write_text(yaml.safe_dump({**TINY_MODEL, **data, "num_gpus": 2, "zero_optimization": {"stage": 1},
                                      "train_iters": 16, "checkpoint_factor": 1, "eval_interval": 3,
                                      "keep_last_n_checkpoints": 4}))
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run([sys.executable, "tests/e2e/workers/fault_driver.py", str(config), str(out), str(seed)],
                            cwd=REPO, env=deepy_environment(), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"seed {seed}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    summary = json.loads((out / "summary.json").read_text())
    kills = summary["kills"]
    death, hang = summary["rank_death"], summary["rank_hang"]
    record_property("suite_counts", (
        f"seed {seed}: {sum(kills.values())} kills survived ({', '.join(f'{n} {k}' for k, n in kills.items())}; "
        f"{summary['async_kills']} of them with async_save); "
        f"resumes exact: training {len(summary['train_mismatches']) == 0} ({summary['train_records']} records), "
        f"validation {len(summary['eval_mismatches']) == 0} ({summary['eval_records']} records); checkpoints lost "
        f"{summary['checkpoints_lost']}, damaged {summary['damaged_checkpoints']}; a dead rank stopped the other in "
        f"{death['seconds']} s, a hung one in {hang['seconds']} s (timeout {hang['timeout_seconds']:g} s)"))
    context = f"seed {seed}: {json.dumps(summary)[:3000]}"
    assert sum(kills.values()) == 20 and summary["segment_failures"] == [], context
    assert summary["async_kills"] == 10, context
    assert summary["straight_exit"] == [0, 0] and summary["final_exit"] == [0, 0], context
    assert summary["final_latest"] == "global_step16", context
    assert summary["checkpoints_lost"] == 0 and summary["damaged_checkpoints"] == 0, context
    assert summary["train_mismatches"] == [] and summary["train_iterations_covered"], context
    assert summary["eval_mismatches"] == [] and summary["eval_iterations_covered"], context
    for case, limit in ((death, 60), (hang, hang["timeout_seconds"] + 60)):
        assert case["survivor_exit"] == 1 and case["seconds"] < limit, context
        assert case["survivor_error"] and "lost another rank during a collective operation" in \
            case["survivor_error"][0], context
