"""Online REINFORCE end to end through deepy.py, with the project's rollout server (tools/rollout_server.py) on
127.0.0.1 sampling from the run's newest checkpoint: a tiny policy learns to write more of one letter (the reward
counts it), the trainer outlives the server's restart (it retries, saying so, and goes on) and the server outlives
the trainer's (a relaunched trainer resumes from its checkpoint and keeps getting rollouts)."""

import itertools
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.launch import REPO, deepy_environment, free_port
from tests.e2e.training_run import TrainingRun

LETTER = "e"
FIRST_STEPS, ALL_STEPS = 8, 20
REWARD_MODULE = f"""
def letter_count(prompts, completions):
    return [float(c.count({LETTER!r})) for c in completions]
"""


def tokenizer(directory: Path) -> dict:
    from megatron.data.corpora import iter_stdlib_texts
    from megatron.tokenizer.training import save_tokenizer, train_byte_level_bpe

    texts = list(itertools.islice(iter_stdlib_texts(), 20))
    save_tokenizer(train_byte_level_bpe(texts, vocab_size=320), directory / "tokenizer.json")
    return {"tokenizer_type": "HFTokenizer", "vocab_file": str(directory / "tokenizer.json")}


def start_server(directory: Path, save: Path, port: int, log: Path) -> subprocess.Popen:
    (directory / "letter_reward.py").write_text(REWARD_MODULE)
    return subprocess.Popen(
        [sys.executable, "-u", str(Path(REPO) / "tools" / "rollout_server.py"), "--save", str(save), "--port",
         str(port), "--reward", "letter_reward:letter_count", "--prompts-per-request", "2",
         "--completions-per-prompt", "8", "--max-new-tokens", "16"],
        cwd=directory, env=deepy_environment(), stdout=open(log, "a"), stderr=subprocess.STDOUT)


def launch_trainer(run: TrainingRun, log: Path, **overrides) -> subprocess.Popen:
    path = run.directory / f"{log.stem}.yml"
    path.write_text(yaml.safe_dump({**run.config, **overrides}))
    return subprocess.Popen([sys.executable, "deepy.py", "train.py", str(path), "--master_port", str(free_port())],
                            cwd=REPO, env=deepy_environment(), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_for_iteration(run: TrainingRun, iteration: int, trainer: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and trainer.poll() is None:
        metrics = run.directory / "logs" / "metrics.jsonl"
        if metrics.exists() and any(r["iteration"] >= iteration for r in run.records()):
            return
        time.sleep(0.2)
    raise AssertionError(f"the trainer did not reach iteration {iteration} (exit {trainer.poll()})")


@pytest.mark.slow
def test_reinforce_learns_the_reward_and_outlives_restarts_of_server_and_trainer(tmp_path):
    port = free_port()
    run = TrainingRun(tmp_path / "run", tokenizer(tmp_path), train_impl="reinforce", dataset_impl="online",
                      online_dataserver_ips="127.0.0.1", online_dataserver_ports=port, reinforce_leave_one_out=True,
                      kl_div_beta=0.01, kl_impl="mse", train_micro_batch_size_per_gpu=16, checkpoint_factor=1,
                      lr_decay_style="constant", warmup=0.0, eval_interval=1000, eval_iters=0, train_iters=ALL_STEPS,
                      optimizer={"type": "Adam", "params": {"lr": 1.0e-2, "betas": [0.9, 0.95], "eps": 1.0e-8}})
    save = run.directory / "ckpt"
    server_log, first_log, second_log = tmp_path / "server.log", tmp_path / "first.log", tmp_path / "second.log"
    server = start_server(tmp_path, save, port, server_log)
    trainer = launch_trainer(run, first_log, exit_interval=FIRST_STEPS)
    try:
        wait_for_iteration(run, 4, trainer)
        server.terminate()  # the server goes away mid-run, and comes back a little later
        server.wait(timeout=30)
        server = start_server(tmp_path, save, port, server_log)
        assert trainer.wait(timeout=300) == 0, first_log.read_text()[-5000:]
        first_out = first_log.read_text()
        assert f"online data server 127.0.0.1:{port} (online_dataserver_ips / online_dataserver_ports)" in \
            first_out and "retrying in" in first_out, first_out[-5000:]

        trainer = launch_trainer(run, second_log)  # the trainer restarts; the same server serves it
        assert trainer.wait(timeout=400) == 0, second_log.read_text()[-5000:]
    finally:
        for process in (trainer, server):
            if process.poll() is None:
                process.kill()
    records = {r["iteration"]: r for r in run.records()}
    assert sorted(records) == list(range(1, ALL_STEPS + 1))
    resumed = f"resumed from checkpoint {save}/global_step{FIRST_STEPS}: iteration {FIRST_STEPS}"
    assert resumed in second_log.read_text()
    rewards = [records[i]["reward"] for i in range(1, ALL_STEPS + 1)]
    print("mean reward per step:", " ".join(f"{r:.2f}" for r in rewards))
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"first 5 steps: {early:.3f}, last 5 steps: {late:.3f}")
    assert late > early + 1.0, rewards
    served = server_log.read_text()
    assert "sampling from" in served and f"global_step{ALL_STEPS - 1}" in served, served[-3000:]
