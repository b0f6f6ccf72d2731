"""What deepy.py says when a launch ends, and how loud DeepSpeed's runner and launcher are.

DeepSpeed's runner and launcher log, at their default level (info), a dozen lines per launch that tell a user
nothing they asked for ("Unable to find hostfile, will proceed with training with local resources only", the
command line, WORLD INFO DICT, CUDA_VISIBLE_DEVICES, "process N spawned"...), and end a run that a signal stopped
with "[ERROR] [...] exits with return code = 143". Both read their level from the runner's own `--log_level`
option (the runner passes it on to the launcher it starts), so deepy.py sets it: `critical` by default (the
runner's and launcher's lines are all below that; the workers' own output, their errors and tracebacks go straight
to the terminal and are not touched), DeepSpeed's `info` with `deepy.py --verbose`. What the launcher's last line
said, deepy.py then says itself, in words (`outcome_message`).

Exit statuses of deepy.py (docs/running.md):
  0        the run finished (or there was nothing to train)
  2        a problem found before launch (config, files, hosts), or a worker's config / checkpoint / data error
  130, 143 stopped by SIGINT / SIGTERM (128 + the signal): the ranks saved a checkpoint first; run the same
           command to resume (megatron.launch.signals)
  other    a rank failed (its error is printed above deepy.py's last line)"""

import os
import signal
from typing import Optional

from megatron.checkpoint.format import read_latest, tag_iteration
from megatron.neox_arguments.groups import NeoXArgsSchema

QUIET_LOG_LEVEL = "critical"
VERBOSE_LOG_LEVEL = "info"
"""DeepSpeed's own default for its runner and launcher."""
INTERRUPTED = {128 + int(signal.SIGINT): "SIGINT", 128 + int(signal.SIGTERM): "SIGTERM"}
"""The exit statuses of ranks stopped by a signal (megatron.launch.signals.interrupted_exit_code)."""


def runner_log_level(verbose: bool) -> list:
    """The runner options that set its and its launcher's log level."""
    return ["--log_level", VERBOSE_LOG_LEVEL if verbose else QUIET_LOG_LEVEL]


def latest_checkpoint(args: NeoXArgsSchema) -> Optional[str]:
    """The tag `latest` names in `save` (None: no save directory, or no checkpoint yet)."""
    return read_latest(args.save) if args.save and os.path.isdir(args.save) else None


def _checkpoint_words(args: NeoXArgsSchema, before: Optional[str]) -> str:
    """Which checkpoint a stopped training run left, compared with the one `save` held at launch (``before``)."""
    if not args.save:
        return "no checkpoint was saved: save is not set"
    tag = latest_checkpoint(args)
    if tag is None:
        return f"no checkpoint was saved in {args.save}"
    where = os.path.join(args.save, tag)
    if tag == before:
        return f"no new checkpoint was saved; the latest is still {where}"
    return f"saved checkpoint {where} (iteration {tag_iteration(tag)})"


def outcome_message(args: NeoXArgsSchema, code: int, received: Optional[str] = None,
                    checkpoint_before: Optional[str] = None) -> Optional[str]:
    """deepy.py's last line for a launch that ended with ``code`` (None for a finished run: the workers' own
    summary says what it did). ``received``: the signal deepy.py itself received and passed on;
    ``checkpoint_before``: latest_checkpoint(args) when the launch started."""
    script = os.path.basename(args.user_script or "the script")
    name = received or INTERRUPTED.get(code)
    if name is not None:
        saved = _checkpoint_words(args, checkpoint_before) if script == "train.py" else None
        resume = "; run the same command to resume" if saved and saved.startswith("saved") else ""
        return (f"deepy.py: {script} stopped by {name}{f': {saved}' if saved else ''}{resume} "
                f"(exit status {code})")
    if code == 0:
        return None
    return f"deepy.py: {script} failed: a rank exited with status {code} (its error is printed above)"
