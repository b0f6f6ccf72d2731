"""adlr_autoresume: GPT-NeoX's (and Megatron-LM's) hook into the job scheduler of NVIDIA's ADLR clusters.

There a job runs under a time limit; the scheduler tells it, through NVIDIA's ``userlib.auto_resume.AutoResume``, that
it is about to be ended, and the job saves a checkpoint, asks to be resubmitted and leaves. GPT-NeoX imports that
class from the directory in the environment variable SUBMIT_SCRIPTS (the cluster's submission scripts), calls
``init()`` on every rank at start and, every ``adlr_autoresume_interval`` iterations, ``termination_requested()``;
when it says yes the run saves, rank 0 calls ``request_resume()`` and every rank exits with status 0.

Here the same: the answer of every rank is agreed in the loop's one stop all-reduce (so all ranks save together, as a
save is collective) and the run ends through the loop's stop path (checkpoint, summary, one line saying why). The
class is the cluster's own code, found where the user pointed SUBMIT_SCRIPTS or on the Python path; it is not a
package this project can depend on, so a run without it is refused at start naming the key and the variable."""
import importlib
import os
import sys
from typing import Any, Mapping, Optional

from megatron.utils.optional_deps import MissingOptionalDependency

MODULE = "userlib.auto_resume"
"""Where NVIDIA's ADLR clusters keep AutoResume (GPT-NeoX's and Megatron-LM's import)."""
DIRECTORY_VARIABLE = "SUBMIT_SCRIPTS"
"""The environment variable naming the directory that holds ``userlib/`` (GPT-NeoX's)."""


def load_autoresume(environ: Mapping[str, str] = os.environ) -> Any:
    """The AutoResume class of ``userlib.auto_resume``, from $SUBMIT_SCRIPTS when set (put first on the path: the
    directory the user named wins over any other ``userlib``), else from the Python path; MissingOptionalDependency
    naming adlr_autoresume and SUBMIT_SCRIPTS when it is not there."""
    directory = environ.get(DIRECTORY_VARIABLE)
    if directory and directory not in sys.path:
        sys.path.insert(0, directory)
    where = f"{DIRECTORY_VARIABLE}={directory!r}" if directory else f"the Python path ({DIRECTORY_VARIABLE} is not set)"
    try:
        module = importlib.import_module(MODULE)
    except ImportError as err:
        raise MissingOptionalDependency(
            f"adlr_autoresume: true needs NVIDIA's ADLR cluster library {MODULE} (AutoResume), which is not found in "
            f"{where}: {err}. Point {DIRECTORY_VARIABLE} at the directory holding userlib/ (on an ADLR cluster, your "
            f"submission scripts), or set adlr_autoresume: false") from None
    autoresume = getattr(module, "AutoResume", None)
    if autoresume is None:
        raise MissingOptionalDependency(f"adlr_autoresume: true: {module.__file__} defines no AutoResume; point "
                                        f"{DIRECTORY_VARIABLE} at the ADLR cluster's userlib, or set "
                                        f"adlr_autoresume: false")
    return autoresume


class AutoResumeCheck:
    """The scheduler's termination request, asked every ``interval`` iterations."""

    def __init__(self, autoresume: Any, interval: int) -> None:
        self.autoresume, self.interval = autoresume, interval

    @classmethod
    def start(cls, neox_args, environ: Mapping[str, str] = os.environ) -> Optional["AutoResumeCheck"]:
        """None when adlr_autoresume is off; else the library loaded and initialised on this rank (as GPT-NeoX does
        on every rank)."""
        if not neox_args.adlr_autoresume:
            return None
        autoresume = load_autoresume(environ)
        autoresume.init()
        return cls(autoresume, neox_args.adlr_autoresume_interval)

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` is one at which the scheduler is asked."""
        return iteration % self.interval == 0

    def termination_requested(self) -> bool:
        """Whether the scheduler asks the job to end (this rank's answer)."""
        return bool(self.autoresume.termination_requested())

    def request_resume(self) -> None:
        """Ask the scheduler to resubmit the job (rank 0 only, after the checkpoint is saved)."""
        self.autoresume.request_resume()
