"""deepy.py's last line (megatron/launch/outcome.py): a stop by a signal is said as a stop with its checkpoint and
exit status, a failure names the status, a finished run adds nothing to the workers' own summary."""

from pathlib import Path

from megatron.launch.outcome import latest_checkpoint, outcome_message, runner_log_level
from tests.neox_arguments.helpers import tiny


def _checkpoint(save: Path, iteration: int) -> None:
    (save / f"global_step{iteration}").mkdir(parents=True)
    (save / "latest").write_text(f"global_step{iteration}\n")


def test_a_stop_by_signal_names_the_checkpoint_it_saved(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    args = tiny(user_script="train.py", save=str(save))
    assert latest_checkpoint(args) is None
    assert outcome_message(args, 143, "SIGTERM", None) == \
        f"deepy.py: train.py stopped by SIGTERM: no checkpoint was saved in {save} (exit status 143)"
    _checkpoint(save, 3)
    before = latest_checkpoint(args)
    _checkpoint(save, 7)
    # a rank stopped by a signal deepy.py did not see itself (scancel, kill): the status says which
    assert outcome_message(args, 130, None, before) == \
        f"deepy.py: train.py stopped by SIGINT: saved checkpoint {save}/global_step7 (iteration 7); run the same " \
        f"command to resume (exit status 130)"
    assert outcome_message(args, 143, "SIGTERM", "global_step7") == \
        f"deepy.py: train.py stopped by SIGTERM: no new checkpoint was saved; the latest is still " \
        f"{save}/global_step7 (exit status 143)"
    assert outcome_message(tiny(user_script="train.py"), 143, "SIGTERM") == \
        "deepy.py: train.py stopped by SIGTERM: no checkpoint was saved: save is not set (exit status 143)"
    assert outcome_message(tiny(user_script="generate.py", save=str(save)), 143, "SIGTERM") == \
        "deepy.py: generate.py stopped by SIGTERM (exit status 143)"


def test_a_failure_names_the_status_and_a_finished_run_adds_nothing() -> None:
    args = tiny(user_script="eval.py")
    assert outcome_message(args, 0) is None
    assert outcome_message(args, 2) == \
        "deepy.py: eval.py failed: a rank exited with status 2 (its error is printed above)"
    assert runner_log_level(False) == ["--log_level", "critical"] and runner_log_level(True) == ["--log_level", "info"]
