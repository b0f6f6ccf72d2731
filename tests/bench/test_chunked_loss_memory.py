"""The chunked-loss benchmark's contenders train the same model to the same first loss (the table itself is produced
by hand: the 6-layer model at seq 2048 takes minutes a step on CPU; the memory claim is tested in
tests/model/test_chunked_loss.py)."""

import pytest

from bench.chunked_loss_memory import CONTENDERS, head_and_loss_times, parse_args, worker


def test_every_contender_trains_to_the_same_first_loss():
    args = parse_args(["--size", "tiny", "--seq", "16", "--batch", "1", "--vocab", "512", "--steps", "1",
                       "--warmup", "0"])
    losses = {}
    for name in CONTENDERS:
        args.contender = name
        result = worker(args)
        assert result["step_time"] > 0
        losses[name] = result["first_loss"]
    assert losses["chunked"] == pytest.approx(losses["unchunked"], abs=1e-5)
    assert losses["per_token"] == pytest.approx(losses["unchunked"], abs=1e-5)


def test_the_head_and_loss_timing_runs_every_contender():
    args = parse_args(["--size", "tiny", "--seq", "8", "--batch", "1", "--vocab", "64", "--head-repeats", "2"])
    times = head_and_loss_times(args)
    assert set(times) == set(CONTENDERS) and all(t > 0 for t in times.values())
