"""Per-rank log files: with `log_dir` set, every worker also writes what it prints to

    <log_dir>/<hostname>_rank<R>_stdout.txt   and   <log_dir>/<hostname>_rank<R>_stderr.txt

(GPT-NeoX writes <hostname>_stdout.txt, which the ranks of one host overwrite; here each rank has its own).
The console is unchanged. On several nodes each node writes its ranks' files into its own log_dir (the
same path everywhere; on a shared filesystem they end up side by side). DeepSpeed's logger, which holds
the original stream, is pointed at the copy too."""

import logging
import os
import socket
import sys
from typing import List, Optional, TextIO


class Tee:
    """A text stream that writes to `stream` and to `path` (appended, flushed with the stream)."""

    def __init__(self, stream: TextIO, path: str) -> None:
        self.stream = stream
        self.file = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, data: str) -> int:
        self.file.write(data)
        return self.stream.write(data)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def close(self) -> None:
        self.file.close()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


_installed: List[Tee] = []


def rank_log_paths(log_dir: str, rank: Optional[int]) -> List[str]:
    stem = os.path.join(log_dir, f"{socket.gethostname()}_rank{rank if rank is not None else 0}")
    return [f"{stem}_stdout.txt", f"{stem}_stderr.txt"]


def tee_rank_output(log_dir: Optional[str], rank: Optional[int]) -> None:
    """Copy this process's stdout and stderr into its per-rank files in log_dir (once; no-op without log_dir)."""
    if not log_dir or _installed:
        return
    os.makedirs(log_dir, exist_ok=True)
    out_path, err_path = rank_log_paths(log_dir, rank)
    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Tee(old_out, out_path), Tee(old_err, err_path)
    _installed.extend([sys.stdout, sys.stderr])
    for name in ("DeepSpeed", ""):
        for handler in logging.getLogger(name).handlers:
            stream = getattr(handler, "stream", None)
            if stream is old_out:
                handler.setStream(sys.stdout)
            elif stream is old_err:
                handler.setStream(sys.stderr)
