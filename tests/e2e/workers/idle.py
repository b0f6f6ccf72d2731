"""A worker that waits to be stopped: rebuilds NeoXArgs like a real worker, writes its pid and its launcher's pid to
NEOX_TEST_OUT/rank<N>.pid, then sleeps (tests of what outlives deepy.py).
Rank 0 holds the run lock of `save`, as a training run's does."""

import os
import time

from megatron.checkpoint.run_lock import RunLock
from megatron.neox_arguments import NeoXArgs

args = NeoXArgs.consume_neox_args()
lock = RunLock(args.save) if args.save and args.rank == 0 else None  # held as a training run's rank 0 holds it
if lock is not None:
    assert lock.acquire() is None
path = os.path.join(os.environ["NEOX_TEST_OUT"], f"rank{args.rank}.pid")
with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
    handle.write(f"{os.getpid()} {os.getppid()}\n")
os.replace(f"{path}.tmp", path)
while True:
    time.sleep(1)
