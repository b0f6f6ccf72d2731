"""One training run per save directory.

Two runs writing one `save` directory interleaved their checkpoints, and one silently replaced the other's.
Rank 0 of a training run holds an exclusive lock (`flock`) on `save/.run.lock` from startup to exit; a second
run finds it held and stops before training, naming the holder (host, pid, start time, written into the file).
The lock belongs to the process: it is released when the run ends in any way, kill -9 included, so a crashed
run never leaves a stale lock behind. deepy.py probes it before launching (megatron.launch.prelaunch)."""

import datetime
import fcntl
import os
import socket
from typing import Optional

LOCK_FILE = ".run.lock"


def _lock_path(save_dir: str) -> str:
    return os.path.join(save_dir, LOCK_FILE)


def _holder_text(handle: int) -> str:
    os.lseek(handle, 0, os.SEEK_SET)
    text = os.read(handle, 4096).decode("utf-8", errors="replace").strip()
    return text or "a process that has not written its name yet"


def _in_use_message(save_dir: str, holder: str) -> str:
    return (f"save='{save_dir}' is in use by another training run ({holder}); two runs writing one save directory "
            f"overwrite each other's checkpoints. Stop that run, or set save (and load) to another directory")


class RunLock:
    """The exclusive lock on a save directory, held from acquire() until release() or the process's end."""

    def __init__(self, save_dir: str) -> None:
        self.save_dir = save_dir
        self._handle: Optional[int] = None

    def acquire(self) -> Optional[str]:
        """Take the lock; returns None, or the message saying who holds it (then nothing is held)."""
        os.makedirs(self.save_dir, exist_ok=True)
        handle = os.open(_lock_path(self.save_dir), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(handle)
            os.close(handle)
            return _in_use_message(self.save_dir, holder)
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(handle, 0)
        os.lseek(handle, 0, os.SEEK_SET)
        os.write(handle, f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n".encode())
        self._handle = handle
        return None

    def release(self) -> None:
        if self._handle is not None:
            os.close(self._handle)  # closing the descriptor releases the flock
            self._handle = None


def lock_problem(save_dir: Optional[str]) -> Optional[str]:
    """The in-use message when another run holds ``save_dir``'s lock now, else None (nothing stays held)."""
    if not save_dir or not os.path.isfile(_lock_path(save_dir)):
        return None
    try:
        handle = os.open(_lock_path(save_dir), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _in_use_message(save_dir, _holder_text(handle))
    finally:
        os.close(handle)
    return None
