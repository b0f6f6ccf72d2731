"""Stopping a run with a signal: what deepy.py does with SIGTERM / SIGINT, and what the workers exit with.

deepy.py runs DeepSpeed's runner in its own process; the runner starts DeepSpeed's launcher (single node) or
pdsh / mpirun / srun (several), which start the ranks. Without help, SIGTERM to deepy.py alone killed it and
left the launcher and the ranks training on, orphaned. `ForwardSignals` passes the signal on:

  * single node: straight to the ranks (the children of DeepSpeed's launcher). Each rank saves a checkpoint at
    its next step boundary and exits; the launcher sees them exit and ends; deepy.py waits for all of it. The
    signal is not sent to DeepSpeed's launcher, whose own handler kills ranks still running 30 s later, which
    would cut a long save short;
  * several nodes: to mpirun / srun, which pass it to the ranks on every node. With pdsh, DeepSpeed's runner
    installs its own handler, which runs `pkill -f <script>` on every node (SIGTERM to each rank) and exits
    after a second, without waiting for the ranks' save.

A rank stopped by a signal exits with `interrupted_exit_code` (128 + the signal's number: 143 for SIGTERM, 130
for SIGINT, the shell's convention), so deepy.py's exit status tells an interrupted run (resume it by running
the same command) from a finished one (0). A rank that stops because another rank was signalled exits 143.

Ctrl-C in a terminal sends SIGINT to deepy.py and to DeepSpeed's launcher at once; the launcher then kills ranks
that have not exited 30 s later. A save that takes longer is lost (the previous checkpoint stays `latest`; a
save never leaves a loadable partial checkpoint): to stop a large model, send SIGTERM to deepy.py alone."""

import signal
import sys
from typing import Any, Dict, List, Optional

import psutil

LAUNCHER_MODULE = "deepspeed.launcher.launch"
FORWARDED = (signal.SIGTERM, signal.SIGINT)


def interrupted_exit_code(signal_name: Optional[str]) -> int:
    """The exit status of a rank stopped by ``signal_name`` (None: another rank's signal, counted as SIGTERM)."""
    signum = getattr(signal, signal_name, signal.SIGTERM) if signal_name else signal.SIGTERM
    return 128 + int(signum)


def _is_deepspeed_launcher(process) -> bool:
    try:
        return LAUNCHER_MODULE in " ".join(process.cmdline())
    except Exception:  # gone, or not ours to read
        return False


def signal_targets(pid: Optional[int] = None) -> List[Any]:
    """The processes a signal to ``pid`` (default: this one) is forwarded to: the ranks under DeepSpeed's
    launcher for a local launch, every other child (pdsh, mpirun, srun) as it is."""
    targets = []
    for child in psutil.Process(pid).children():
        if _is_deepspeed_launcher(child):
            targets += child.children()
        else:
            targets.append(child)
    return targets


class ForwardSignals:
    """While installed, SIGTERM / SIGINT to this process are passed on to the ranks (see the module docstring);
    this process goes on waiting for them. Before anything is started, the signal ends this process."""

    def __init__(self) -> None:
        self.received: Optional[str] = None
        self._previous: Dict[int, Any] = {}

    def install(self) -> "ForwardSignals":
        for sig in FORWARDED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def targets(self) -> List[Any]:
        """The processes a signal is passed on to (signal_targets: the ranks of a local launch)."""
        return signal_targets()

    def _handle(self, signum: int, _frame) -> None:
        self.received = signal.Signals(signum).name
        targets = self.targets()
        if not targets:
            sys.exit(128 + signum)
        for process in targets:
            try:
                process.send_signal(signum)
            except Exception:  # already gone
                pass
        print(f"deepy.py: {self.received} passed on to {len(targets)} process(es) "
              f"({', '.join(str(p.pid) for p in targets)}); waiting for them to save and exit", file=sys.stderr,
              flush=True)


def killed_rank_message(runner_code: Any) -> Optional[str]:
    """What deepy.py says when DeepSpeed's runner ends with the status of a rank killed by a signal, or None.
    DeepSpeed's launcher stops the other ranks and exits with the dead rank's returncode, -signum, which the shell
    sees as 256 - signum (247 for SIGKILL, 250 for SIGUSR1...): a number that names nothing. Ranks themselves exit 0,
    1, 2 or 128 + signum (129..159), so 225..255 can only be a rank killed by signal 256 - code."""
    if not isinstance(runner_code, int) or not 256 - 31 <= runner_code <= 255:
        return None
    try:
        name = signal.Signals(256 - runner_code).name
    except ValueError:
        return None
    return (f"a rank was killed by {name} (the machine's out-of-memory killer, or someone; its log says how far it "
            f"got), and DeepSpeed's launcher stopped the other ranks. The run stopped here; relaunch it to resume "
            f"from its last checkpoint")
