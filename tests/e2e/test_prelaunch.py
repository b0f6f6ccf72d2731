"""Errors before launch: deepy.py reports wrong paths, unreachable hosts, a missing rank-0 address, a taken
master port, a finished run and config problems at once, in a second, and starts no worker.

Most tests run deepy.main in this process with DeepSpeed's runner replaced by a recorder, so "no worker
started" is checked exactly (the recorder was not called); a few run `python deepy.py` / `python train.py`
as a user would. ssh is a stand-in script on PATH: no test reaches any host."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import deepy
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.launcher import ENCODED_CONFIG_ENV
from tests.e2e.launch import REPO, run_deepy

BASE = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
    "max_position_embeddings": 32, "train_micro_batch_size_per_gpu": 2, "num_gpus": 1, "train_iters": 8,
    "optimizer": {"type": "Adam", "params": {"lr": 1.0e-3}}, "tokenizer_type": "HFTokenizer",
}

FAKE_SSH = """#!/bin/sh
# a stand-in for ssh: hosts named node-down* refuse, `hostname -I` prints an address
for last; do :; done
case "$*" in *node-down*) echo "ssh: connect to host node-down port 22: Connection refused" >&2; exit 255;; esac
[ "$last" = "hostname -I" ] && echo "10.9.8.7 fe80::1"
exit 0
"""


@pytest.fixture
def files(tmp_path):
    """A dataset and a tokenizer file that exist (prelaunch checks existence only)."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{suffix}").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    return {"data_path": str(tmp_path / "corpus_text_document"), "vocab_file": str(tmp_path / "tokenizer.json")}


@pytest.fixture
def deepy_main(tmp_path, monkeypatch, capsys):
    """Run deepy.main(argv) with a recording runner; returns (exit status, stderr, runner argvs)."""
    calls = []
    monkeypatch.setattr("deepspeed.launcher.runner.main", lambda argv=None: calls.append(list(argv)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in (ENCODED_CONFIG_ENV, "MASTER_ADDR"):  # set, then deleted: monkeypatch removes deepy's value after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def run(config, *extra, script="train.py"):
        path = tmp_path / f"config{time.time_ns()}.yml"
        path.write_text(yaml.safe_dump(config))
        capsys.readouterr()
        code = deepy.main([str(Path(REPO) / script), str(path), *extra])
        return code, capsys.readouterr().err, calls

    return run


def test_missing_data_and_tokenizer_files_are_reported_together(deepy_main, tmp_path):
    config = {**BASE, "data_path": str(tmp_path / "nowhere" / "corpus"), "tokenizer_type": "GPT2BPETokenizer",
              "vocab_file": str(tmp_path / "vocab.json")}
    code, err, launched = deepy_main(config)
    assert code == 2 and launched == []
    assert f"data_path: '{tmp_path / 'nowhere' / 'corpus.idx'}' and '{tmp_path / 'nowhere' / 'corpus.bin'}' not " \
           f"found" in err
    assert f"vocab_file file not found: '{tmp_path / 'vocab.json'}'" in err
    assert "tokenizer_type=GPT2BPETokenizer needs merge_file" in err
    assert "(3 problems)" in err


def test_separate_data_path_lists_and_a_suffix_written_by_mistake(deepy_main, files):
    prefix = files["data_path"]
    config = {**BASE, **files, "data_path": None, "train_data_paths": [prefix + ".bin"],
              "valid_data_paths": [prefix], "test_data_paths": [prefix + "_missing"]}
    code, err, launched = deepy_main(config)
    assert code == 2 and launched == []
    assert f"train_data_paths: '{prefix}.bin.idx' and '{prefix}.bin.bin' not found (data paths are prefixes " \
           f"without .bin/.idx: write '{prefix}')" in err
    assert f"test_data_paths: '{prefix}_missing.idx'" in err
    assert "valid_data_paths" not in err


def test_load_directory_that_does_not_exist(deepy_main, files, tmp_path):
    code, err, launched = deepy_main({**BASE, **files, "load": str(tmp_path / "old_run"),
                                      "save": str(tmp_path / "new")})
    assert code == 2 and launched == []
    assert f"load directory '{tmp_path / 'old_run'}' does not exist: there is no checkpoint to resume from" in err
    # the first run of a config that saves and resumes in one directory starts from scratch
    code, _, launched = deepy_main({**BASE, **files, "load": str(tmp_path / "ckpt"), "save": str(tmp_path / "ckpt")})
    assert code == 0 and len(launched) == 1


def test_a_missing_prompts_file_or_eval_task_file_is_named_before_launch(deepy_main, files, tmp_path):
    """generate.py's -i file and eval_tasks' local task files are the launching machine's to check: one message
    naming the file, exit status 2, no worker started (the workers would each fail after their start-up)."""
    from tests.evaluation.local_tasks import write_local_tasks

    code, err, launched = deepy_main({**BASE, **files}, "-i", str(tmp_path / "nope.txt"), script="generate.py")
    assert code == 2 and launched == [] and "Traceback" not in err
    assert f"sample_input_file not found: '{tmp_path / 'nope.txt'}'" in err
    tasks = write_local_tasks(tmp_path / "tasks", docs=2)
    missing = str(tmp_path / "no_such_task.yaml")
    for script in ("eval.py", "train.py"):
        code, err, launched = deepy_main({**BASE, **files, "eval_tasks": [str(tmp_path / "tasks"), missing]},
                                         script=script)
        assert code == 2 and launched == [] and "Traceback" not in err, script
        assert f"eval_tasks entry {missing!r}: no such file or directory" in err, script
    (tmp_path / "prompts.txt").write_text("def f(x):\n")
    code, _, launched = deepy_main({**BASE, **files}, "-i", str(tmp_path / "prompts.txt"), script="generate.py")
    assert code == 0 and len(launched) == 1
    code, _, launched = deepy_main({**BASE, **files, "eval_tasks": [str(tasks["neox_mc_local"])]}, script="eval.py")
    assert code == 0 and len(launched) == 2


@pytest.mark.fault
@pytest.mark.attack("a save directory under a file or on a read-only filesystem: a traceback at the first save")
def test_a_save_directory_that_cannot_be_written_is_named(deepy_main, files, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, err, launched = deepy_main({**BASE, **files, "save": str(blocker / "ckpt")})
    assert code == 2 and launched == []
    assert f"save='{blocker / 'ckpt'}' cannot be created: '{blocker}' is a file" in err

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("tempfile.mkstemp", read_only)  # root writes through permission bits: a ro mount
    code, err, launched = deepy_main({**BASE, **files, "save": str(tmp_path / "runs" / "ckpt")})
    assert code == 2 and launched == []
    assert f"save='{tmp_path / 'runs' / 'ckpt'}' is not writable: creating a file in '{tmp_path}' failed " \
           f"(Read-only file system)" in err


@pytest.mark.fault
@pytest.mark.attack("a second run on a save directory another run is writing, to interleave and replace its "
                    "checkpoints")
def test_a_save_directory_another_run_is_writing_is_refused(deepy_main, files, tmp_path):
    """The run lock (megatron.checkpoint.run_lock) is held by another process: deepy.py names it and starts nothing."""
    ckpt = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from megatron.checkpoint.run_lock import RunLock; "
                               f"assert RunLock({str(ckpt)!r}).acquire() is None; print('held', flush=True); "
                               "time.sleep(600)"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO})
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err, launched = deepy_main({**BASE, **files, "save": str(ckpt)})
        assert code == 2 and launched == []
        assert f"save='{ckpt}' is in use by another training run (host {socket.gethostname()}, pid {holder.pid}, " \
               f"since " in err
    finally:
        holder.kill()
        holder.wait()
    code, _, launched = deepy_main({**BASE, **files, "save": str(ckpt)})  # killed -9: no stale lock
    assert code == 0 and len(launched) == 1


def test_re_running_a_finished_run_says_it_is_at_train_iters(deepy_main, files, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step8").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step8\n")
    code, err, launched = deepy_main({**BASE, **files, "load": str(ckpt), "save": str(ckpt)})
    assert code == 0 and launched == []
    assert f"nothing to train: the checkpoint in load='{ckpt}' is at iteration 8 and train_iters=8" in err
    code, _, launched = deepy_main({**BASE, **files, "load": str(ckpt), "save": str(ckpt), "train_iters": 12})
    assert code == 0 and len(launched) == 1
    samples = {**BASE, **files, "load": str(ckpt), "save": str(ckpt), "train_iters": None}
    code, err, launched = deepy_main({**samples, "train_samples": 8 * 2 - 1})  # rounds up to 8 iterations
    assert code == 0 and len(launched) == 1  # the runner's calls so far: only the train_iters=12 one
    assert f"is at iteration 8 and train_samples=15 (8 iterations); raise train_samples" in err
    code, _, launched = deepy_main({**samples, "train_samples": 8 * 2 + 1})
    assert code == 0 and len(launched) == 2


def test_re_running_a_finished_epoch_run_says_so(deepy_main, tmp_path):
    """With train_epochs the run's length comes from the data: 10 documents of 64 tokens = 20 samples of 32,
    batch 2 -> 10 iterations an epoch, counted before launch as the worker counts them."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    builder = MMapIndexedDatasetBuilder(tmp_path / "corpus_text_document")
    for doc in range(10):
        builder.add_document([list(range(doc, doc + 64))])
    builder.finalize()
    (tmp_path / "tokenizer.json").write_text("{}")
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step20").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step20\n")
    config = {**BASE, "train_iters": None, "train_epochs": 2, "split": "100,0,0",
              "data_path": str(tmp_path / "corpus_text_document"), "vocab_file": str(tmp_path / "tokenizer.json"),
              "load": str(ckpt), "save": str(ckpt)}
    code, err, launched = deepy_main(config)
    assert code == 0 and launched == []
    assert f"nothing to train: the checkpoint in load='{ckpt}' is at iteration 20 and train_epochs=2 " \
           f"(20 iterations); raise train_epochs" in err
    code, _, launched = deepy_main({**config, "train_epochs": 3})
    assert code == 0 and len(launched) == 1


def test_a_host_that_does_not_answer_ssh_is_named(deepy_main, files, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-down slots=1\n")
    code, err, launched = deepy_main({**BASE, **files, "num_gpus": None, "hostfile": str(hostfile),
                                      "master_addr": "10.0.0.1"})
    assert code == 2 and launched == []
    assert f"hostfile '{hostfile}': host 'node-down' does not answer passwordless ssh (ssh: connect to host " \
           f"node-down port 22: Connection refused)" in err
    assert "'node-a'" not in err


def test_rank_zero_address_is_found_or_asked_for(deepy_main, files, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    config = {**BASE, **files, "num_gpus": None, "hostfile": str(hostfile), "launcher": "openmpi"}
    code, err, launched = deepy_main({**config, "no_ssh_check": True})
    assert code == 2 and launched == []
    assert "master_addr is not set and launcher=openmpi gives the workers no address of rank 0" in err
    assert "set master_addr to the address of 'node-a'" in err
    # with ssh, as DeepSpeed's runner does: the first address `hostname -I` prints on the first host, which the
    # workers of mpirun (that the runner does not tell) receive in the config
    code, err, launched = deepy_main(config)
    assert code == 0, err
    argv = launched[-1]
    assert "--master_addr=10.9.8.7" in argv
    assert NeoXArgs.decode(os.environ[ENCODED_CONFIG_ENV]).master_addr == "10.9.8.7"


@pytest.mark.parametrize("hostile", ["10.0.0.1;touch /tmp/neox_pwned", "$(touch /tmp/neox_pwned)", "node\nrm -rf x",
                                     "`id`"])
@pytest.mark.fault
@pytest.mark.attack("shell metacharacters in master_addr, forwarded variables and slurm's comment, to run a "
                    "command through a launcher's shell")
def test_hostile_values_never_reach_a_shell(deepy_main, files, tmp_path, monkeypatch, hostile):
    """Values a launcher would pass to a shell unquoted are refused before anything starts: master_addr for every
    launcher; with pdsh also the script path and the forwarded variables, which DeepSpeed's runner writes into each
    node's shell command (issue 19). slurm's comment reaches srun as one argument, whatever it holds."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    multi = {**BASE, **files, "num_gpus": None, "hostfile": str(hostfile)}
    for launcher in ("pdsh", "openmpi", "slurm"):
        code, err, launched = deepy_main({**multi, "launcher": launcher, "master_addr": hostile})
        assert code == 2 and launched == [], (launcher, err)
        assert f"master_addr={hostile!r} is not a host name or address" in err
    monkeypatch.setenv("PYTHONNEOXTEST", hostile)
    code, err, launched = deepy_main({**multi, "launcher": "pdsh", "master_addr": "10.0.0.1"})
    assert code == 2 and launched == []
    assert f"launcher=pdsh: DeepSpeed's runner writes the variable PYTHONNEOXTEST ({hostile[:80]!r}) into the shell " \
           f"command every node runs without quoting it" in err
    code, err, launched = deepy_main({**multi, "launcher": "slurm", "master_addr": "10.0.0.1", "comment": hostile,
                                      "no_ssh_check": True})
    assert code == 0 and len(launched) == 1, err  # mpirun / srun receive values as arguments: no shell
    from shlex import split

    argv = launched[0]
    launcher_args = next(a for a in argv if a.startswith("--launcher_args="))
    assert split(launcher_args.split("=", 1)[1]) == ["--comment", hostile]  # as DeepSpeed splits it
    assert not os.path.exists("/tmp/neox_pwned")


@pytest.mark.attack("hostfile hosts named as ssh options (-oProxyCommand=..., -F.file), probed with the real ssh")
def test_a_host_named_as_an_option_never_reaches_ssh(deepy_main, files, tmp_path, monkeypatch):
    """The host names are checked before any ssh probe, and ssh's argv has `--` before the host: a host named
    -oProxyCommand=touch${IFS}MARKER (which ssh would run through a shell) or -F.evil (an ssh config file) is
    refused by name and never run (issue 32). The real ssh is on PATH here: the probe of a name that slipped
    through would run its command."""
    marker = tmp_path / "ran"
    monkeypatch.setenv("PATH", os.environ["PATH"].split(os.pathsep, 1)[1])  # the real ssh, not the stand-in
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"-oProxyCommand=touch${{IFS}}{marker} slots=1\n-F.evil slots=1\n")
    code, err, launched = deepy_main({**BASE, **files, "num_gpus": None, "hostfile": str(hostfile),
                                      "launcher": "pdsh"})
    assert not marker.exists(), "ssh ran the host name's ProxyCommand"
    assert code == 2 and launched == [], err
    assert f"host '-oProxyCommand=touch${{IFS}}{marker}' is not a host name or address" in err
    assert "host '-F.evil' is not a host name or address" in err and "passwordless ssh" not in err
    monkeypatch.chdir(tmp_path)
    dashed = tmp_path / "-hostfile"
    dashed.write_text("node-a slots=1\nnode-b slots=1\n")
    code, err, launched = deepy_main({**BASE, **files, "num_gpus": None, "hostfile": "-hostfile",
                                      "launcher": "openmpi", "master_addr": "10.0.0.1", "no_ssh_check": True})
    assert code == 2 and launched == [] and "hostfile '-hostfile' begins with '-'" in err, err


def test_ssh_probes_put_the_host_after_double_dash(monkeypatch):
    from megatron.launch import prelaunch

    calls = []
    monkeypatch.setattr(prelaunch.subprocess, "run", lambda argv, **_: calls.append(argv))
    prelaunch._ssh("node-a", "true", ssh_port=2222)
    assert calls[0][-3:] == ["--", "node-a", "true"]
    assert prelaunch._ssh("-oProxyCommand=x", "true").returncode == 2 and len(calls) == 1


def test_a_taken_master_port_is_replaced_by_a_free_one(deepy_main, files):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, err, launched = deepy_main({**BASE, **files, "master_port": port})
    assert code == 0 and len(launched) == 1
    argv = launched[0]
    chosen = int(argv[argv.index("--master_port") + 1])
    assert chosen != port
    assert f"master_port {port} is in use on this machine (another run?); rank 0 listens on free port {chosen}" in err
    assert NeoXArgs.decode(os.environ[ENCODED_CONFIG_ENV]).master_port == chosen


def test_more_cpu_ranks_than_cores_warns(deepy_main, files):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU ranks only")
    cores = len(os.sched_getaffinity(0))
    code, err, launched = deepy_main({**BASE, **files, "num_gpus": cores + 1})
    assert code == 0 and len(launched) == 1
    assert f"warning: num_gpus={cores + 1}: {cores + 1} CPU ranks on this machine's {cores} cores" in err


def test_a_type_error_does_not_hide_a_bad_head_count(deepy_main, files):
    code, err, launched = deepy_main({**BASE, **files, "num_attention_heads": 5, "lr_decay_style": 3,
                                      "train_micro_batch_size_per_gpu": "two"})
    assert code == 2 and launched == []
    assert "train_micro_batch_size_per_gpu='two'" in err and "lr_decay_style=3" in err
    assert "hidden_size=64 must be divisible by num_attention_heads=5" in err


def test_the_real_command_fails_in_seconds_without_starting_a_worker(tmp_path):
    config = tmp_path / "bad.yml"
    config.write_text(yaml.safe_dump({**BASE, "data_path": str(tmp_path / "missing"),
                                      "vocab_file": str(tmp_path / "tokenizer.json")}))
    started = time.time()
    result = run_deepy(["train.py", str(config)], timeout=120)
    assert result.returncode == 2, result.stderr
    assert time.time() - started < 30
    assert f"data_path: '{tmp_path / 'missing.idx'}'" in result.stderr
    assert f"vocab_file file not found: '{tmp_path / 'tokenizer.json'}'" in result.stderr
    assert "Traceback" not in result.stderr and "cmd = " not in result.stdout + result.stderr


def test_python_train_py_says_to_use_deepy(tmp_path):
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(BASE))
    result = subprocess.run([sys.executable, "train.py", str(config)], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 2
    assert f"train.py is a worker script and received no config: start it through deepy.py" in result.stderr
    assert f"python deepy.py train.py {config}" in result.stderr
    assert "Traceback" not in result.stderr


def test_dlts_hostfile_from_the_environment_as_in_gpt_neox(files, tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump({**BASE, **files, "num_gpus": None}))
    monkeypatch.setenv("DLTS_HOSTFILE", str(hostfile))
    args = deepy.load_args([str(Path(REPO) / "train.py"), str(config)])
    assert args.hostfile == str(hostfile) and args.global_num_gpus == 4
    with pytest.warns(UserWarning, match="hostfile '/none' does not exist"):  # -H wins
        assert deepy.load_args([str(Path(REPO) / "train.py"), str(config), "-H", "/none"]).hostfile == "/none"


def test_a_malformed_hostfile_is_named(deepy_main, files, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b 4\n")
    code, err, launched = deepy_main({**BASE, **files, "num_gpus": None, "hostfile": str(hostfile)})
    assert code == 2 and launched == []
    assert f"hostfile '{hostfile}'" in err and "each line must read 'HOSTNAME slots=N'" in err


def test_a_port_taken_after_the_check_is_named_by_the_worker(tmp_path):
    """Between deepy.py's check and rank 0's listen another process may take the port: the worker says so
    in one line instead of torch's DistNetworkError traceback."""
    config = {**BASE, "data_path": str(tmp_path / "corpus"), "vocab_file": str(tmp_path / "tokenizer.json")}
    encoded = NeoXArgs.from_dict({**config, "user_script": "train.py"}).encode()
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": REPO, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               ENCODED_CONFIG_ENV: encoded}
        result = subprocess.run([sys.executable, "train.py"], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"master_port: rank 0 cannot listen on 127.0.0.1:{port}, another process uses that port" in result.stderr
    assert "Traceback" not in result.stderr


def test_training_settings_and_files_in_one_round(deepy_main, files, tmp_path):
    config = {**BASE, **files, "optimizer": None, "vocab_file": str(tmp_path / "gone.json")}
    code, err, launched = deepy_main(config)
    assert code == 2 and launched == []
    assert "an optimizer dict is required for training" in err and "vocab_file file not found" in err


def test_config_file_package_and_device_problems_in_one_report(deepy_main, files, tmp_path, monkeypatch):
    """Issue 31: a config problem used to hide the file problems until the next launch; a missing extra failed
    after the model was built (then 'rank 1 lost another rank'); fp16 on CPU was an error printed by every rank.
    Now one report before any worker starts, and a data path written as preprocess_data.py's --output-prefix
    names the file it wrote."""
    import megatron.launch.prelaunch as prelaunch
    import megatron.utils.optional_deps as optional_deps

    monkeypatch.setattr(optional_deps, "installed", lambda package: package not in ("tensorboard", "wandb"))
    monkeypatch.setattr(prelaunch, "_cuda_available", lambda: False)
    prefix = files["data_path"][:-len("_text_document")]
    config = {**BASE, **files, "num_attention_heads": 5, "data_path": prefix,
              "vocab_file": str(tmp_path / "gone.json"), "tensorboard_dir": str(tmp_path / "tb"),
              "tensorboard": {"enabled": True, "output_path": str(tmp_path / "ds_tb")}, "use_wandb": True,
              "fp16": {"enabled": True}}
    code, err, launched = deepy_main(config)
    assert code == 2 and launched == [] and "Traceback" not in err
    assert "hidden_size=64 must be divisible by num_attention_heads=5" in err
    assert f"data_path: '{prefix}.idx' and '{prefix}.bin' not found (preprocess_data.py names its output " \
           f"<output-prefix>_<json key>_document: write '{files['data_path']}')" in err
    assert f"vocab_file file not found: '{tmp_path / 'gone.json'}'" in err
    assert f"tensorboard_dir={str(tmp_path / 'tb')!r} and the DeepSpeed section tensorboard: {{enabled: true}} need " \
           f"the Python package 'tensorboard', which is not installed: pip install -r " \
           f"requirements/requirements-tensorboard.txt (or turn them off)" in err
    assert "use_wandb: true needs the Python package 'wandb'" in err
    assert "fp16 needs a CUDA GPU and this machine, where the ranks would run, has none" in err
    assert "(6 problems)" in err
    # the config fixed: the same file, package and device problems, from the validated config
    code, err, launched = deepy_main({**config, "num_attention_heads": 4})
    assert code == 2 and launched == [] and "(5 problems)" in err and "fp16 needs a CUDA GPU" in err


def test_nccl_on_a_machine_without_cuda_is_said_once_and_the_launcher_is_quiet(deepy_main, files, monkeypatch):
    """distributed_backend nccl on CPU ranks: gloo, said once by deepy.py (not silently by each rank). DeepSpeed's
    runner and launcher log only critical errors unless --verbose; DeepSpeed's CPU accelerator is named for
    local CPU ranks instead of each process warning that it fell back to it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU ranks only")
    monkeypatch.setenv("DS_ACCELERATOR", "")
    monkeypatch.delenv("DS_ACCELERATOR")
    code, err, launched = deepy_main({**BASE, **files, "distributed_backend": "nccl"})
    assert code == 0 and len(launched) == 1
    assert err.count("note: distributed_backend=nccl needs CUDA and this machine has none: the ranks communicate "
                     "with gloo") == 1
    assert launched[0][:2] == ["--log_level", "critical"] and os.environ["DS_ACCELERATOR"] == "cpu"
    code, err, launched = deepy_main({**BASE, **files, "distributed_backend": "gloo"}, "--verbose")
    assert code == 0 and launched[1][:2] == ["--log_level", "info"] and "distributed_backend" not in err


@pytest.mark.attack("a config file that is not UTF-8, and one holding a YAML alias bomb, handed to deepy.py")
def test_a_config_that_is_not_utf8_or_explodes_is_named_before_launch(deepy_main, files, tmp_path, capsys):
    from tests.utils.test_text_files import alias_bomb

    latin1, bomb = tmp_path / "latin1.yml", tmp_path / "bomb.yml"
    latin1.write_bytes(b"# r\xe9glages\nnum_layers: 2\n")
    bomb.write_text(alias_bomb())
    for path, expected in ((latin1, f"{latin1} is not UTF-8 text: the byte (0xe9) at byte offset 3, line 1"),
                           (bomb, f"{bomb}: YAML value refused at line 8, column 7: its aliases (*name) expand")):
        code, err, launched = deepy_main({**BASE, **files}, str(path))
        assert code == 2 and launched == [] and "Traceback" not in err, err
        assert expected in err, err


@pytest.mark.attack("generate.py's -i prompt file is not UTF-8")
def test_a_prompts_file_that_is_not_utf8_is_named_before_launch(deepy_main, files, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"first prompt\nsecond \xff prompt\n")
    code, err, launched = deepy_main({**BASE, **files}, "-i", str(prompts), script="generate.py")
    assert code == 2 and launched == [] and "Traceback" not in err
    assert f"sample_input_file: {prompts} is not UTF-8 text: the byte (0xff) at byte offset 20, line 2 does not " \
           f"decode" in err, err
    import generate  # the worker reads it the same way (a file changed after launch)
    from megatron.inference.text_generation import GenerationError

    with pytest.raises(GenerationError, match=f"{prompts} is not UTF-8 text: the byte \\(0xff\\) at byte offset 20"):
        generate._file_prompts(SimpleNamespace(sample_input_file=str(prompts), prompt_end="\n"))


@pytest.mark.fault
def test_a_rank_killed_by_a_signal_makes_deepy_exit_1_with_one_line(deepy_main, files, monkeypatch):
    """DeepSpeed's launcher exits with a killed rank's returncode, -9, which reached the shell as 247; README promises
    exit 1 and one error line for a lost rank. A rank's own failure status (2) still passes through as it is."""
    def runner(code):
        def main(argv=None):
            raise SystemExit(code)
        return main

    monkeypatch.setattr("deepspeed.launcher.runner.main", runner(247))
    code, err, _ = deepy_main({**BASE, **files})
    assert code == 1, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: a rank was killed by SIGKILL (the machine's out-of-memory killer, or someone; its log says how far "
        "it got), and DeepSpeed's launcher stopped the other ranks. The run stopped here; relaunch it to resume "
        "from its last checkpoint"], err
    monkeypatch.setattr("deepspeed.launcher.runner.main", runner(2))
    code, err, _ = deepy_main({**BASE, **files})
    assert code == 2 and "error: a rank was killed" not in err, err


@pytest.mark.attack("hidden_size: 1048576 (a typo for 1024): terabytes of parameters")
def test_a_model_that_cannot_fit_is_refused_before_launch_with_the_numbers(deepy_main, files):
    code, err, launched = deepy_main({**BASE, **files, "hidden_size": 1048576})
    assert code == 2 and launched == [] and "Traceback" not in err, err
    assert "the model cannot fit: each rank needs at least 327,688.5 GiB (21,990,232,555,520 parameters with " \
           "hidden_size=1048576, num_layers=2: weights 81,920.0 GiB, gradients 81,920.0 GiB, optimizer states " \
           "163,840.0 GiB, activations 8.5 GiB" in err, err
    assert "Check hidden_size and num_layers for a typo" in err


@pytest.mark.attack("data_cache_path naming a file, or a read-only directory")
def test_a_data_cache_path_that_cannot_be_written_is_named_before_launch(deepy_main, files, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, err, launched = deepy_main({**BASE, **files, "data_cache_path": str(blocker)})
    assert code == 2 and launched == []
    assert f"data_cache_path='{blocker}' is a file; it must be a directory (the index maps are cached in it)" in err

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("tempfile.mkstemp", read_only)
    code, err, launched = deepy_main({**BASE, **files, "data_cache_path": str(tmp_path / "maps")})
    assert code == 2 and launched == []
    assert f"data_cache_path='{tmp_path / 'maps'}' is not writable: creating a file in '{tmp_path}' failed " \
           f"(Read-only file system)" in err, err
