"""StopRequested: SIGTERM / SIGINT are recorded by the training process and left alone in its forked
children (the loop itself is exercised end to end in tests/e2e)."""
import os
import signal
import time

from megatron.training import StopRequested


def test_parent_records_the_signal_and_a_forked_child_dies_of_it():
    """A forked child is what multiprocessing pools start (lm-eval's stderr bootstrap during eval_tasks);
    Pool.terminate() stops them with SIGTERM and waits, forever when they ignore it."""
    stop = StopRequested()
    stop.install()
    try:
        pid = os.fork()
        if pid == 0:  # the child waits to be terminated
            time.sleep(30)
            os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert stop.signal_name is None
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5
        while stop.signal_name is None and time.time() < deadline:
            time.sleep(0.01)
        assert stop.signal_name == "SIGTERM"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle
