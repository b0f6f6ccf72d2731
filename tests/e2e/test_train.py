"""Training end to end through deepy.py on CPU ranks: it learns, saves, resumes exactly, and tensor and
pipeline parallelism reproduce the single-rank losses."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.launch import REPO, deepy_environment, free_port
from tests.e2e.training_run import TINY_MODEL, TrainingRun, build_tiny_corpus, falls

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def single_rank_losses(data, tmp_path_factory):
    """The reference: one rank, fp32, 12 steps of 8 sequences."""
    run = TrainingRun(tmp_path_factory.mktemp("reference"), data, num_gpus=1, train_iters=12,
                      train_batch_size=8, gradient_accumulation_steps=2, save=None, load=None)
    run.launch()
    run.assert_ok()
    return run.losses()


def test_bf16_zero3_data_parallel_trains_and_resumes(data, tmp_path):
    """bf16 under ZeRO-3 on two ranks (one launch for both: bf16 with ZeRO 0-2 goes through DeepSpeed's bf16
    optimizer, tested in process by tests/checkpoint/test_resharding.py) learns, saves and continues."""
    run = TrainingRun(tmp_path, data, num_gpus=2, bf16={"enabled": True}, zero_optimization={"stage": 3},
                      train_iters=10, checkpoint_factor=10)
    run.launch()
    run.assert_ok()
    assert falls(run.losses()) and run.latest() == "global_step10"
    run.launch(train_iters=12, override_lr_scheduler=True)
    run.assert_ok()
    assert [r["iteration"] for r in run.records()][-2:] == [11, 12]


def test_tensor_parallel_matches_single_rank(data, tmp_path, single_rank_losses):
    """TP=2 reproduces one rank's losses (its exact resume through deepy.py: tests/e2e/test_deepspeed_features.py,
    tests/e2e/test_gpt_neox_checkpoints.py and the DPO run of tests/e2e/test_post_training.py)."""
    run = TrainingRun(tmp_path, data, num_gpus=2, train_iters=12, train_batch_size=8, gradient_accumulation_steps=2,
                      save=None, load=None, model_parallel_size=2)
    run.launch()
    run.assert_ok()
    losses = run.losses()
    for it, loss in single_rank_losses.items():
        assert losses[it] == pytest.approx(loss, rel=2e-4, abs=2e-4), it


def test_pipeline_matches_single_rank_logs_every_stage_and_resumes(data, tmp_path, single_rank_losses):
    """PP=2 with ZeRO 1 reproduces one rank's losses and continues from its checkpoint. GPT-NeoX's Pythia 12B / 2.8B
    configs log gradient norms with a pipeline and ZeRO 1: metrics.jsonl (written by rank 0, the first stage) holds
    both stages' parameters under the sequential model's names, the tied embedding once, and totals that are the
    norm DeepSpeed clips with."""
    run = TrainingRun(tmp_path, data, num_gpus=2, train_iters=12, train_batch_size=8, gradient_accumulation_steps=2,
                      checkpoint_factor=12, pipe_parallel_size=2, zero_optimization={"stage": 1},
                      log_grad_norm=True, log_grad_pct_zeros=True, log_optimizer_states=True, steps_per_print=1,
                      log_gradient_noise_scale=True, gradient_noise_scale_n_batches=3, profile=True,
                      profile_step_start=0, profile_step_stop=0, checkpoint_validation_with_forward_pass=True)
    run.launch()
    run.assert_ok()
    # one loss line per logged step: not DeepSpeed's pipeline engine's `steps: N loss: X` beside it (issue 31)
    assert run.result.stdout.count("lm_loss") >= 12 and "steps: " not in run.result.stdout, run.result.stdout
    losses = run.losses()
    for it, loss in single_rank_losses.items():
        assert losses[it] == pytest.approx(loss, rel=2e-4, abs=2e-4), it
    train = run.records("train")
    assert [r["iteration"] for r in train] == list(range(1, 13))
    for record in train:
        norms = {k.split("/", 1)[1]: v for k, v in record.items() if k.startswith("gradient_norms/")}
        # stage 0: the embedding (tied to the last stage's head) and layer slot 2; stage 1: slot 3 and the final norm
        assert "sequential.0.word_embeddings.weight" in norms and "tied_modules.embed.word_embeddings.weight" not in norms
        for slot in ("2", "3", "5"):
            assert any(name.startswith(f"sequential.{slot}.") for name in norms), slot
        assert record["grad_norm_total"] == pytest.approx(record["grad_norm"], rel=1e-5)
        assert record["grad_norm_total"] == pytest.approx(math.sqrt(sum(v * v for v in norms.values())), rel=1e-9)
        assert {k.split("/", 1)[1] for k in record if k.startswith("gradient_pct_zeros/")} == set(norms)
        states = {k.split("/", 1)[1] for k in record if k.startswith("optimizer_state_norms/")}
        # before the first optimizer step there are no states; after it, Adam's two for every parameter
        assert states == (set() if record["iteration"] == 1 else
                          {f"{name}/{key}" for name in norms for key in ("exp_avg", "exp_avg_sq")})
    # the gradient noise scale of both stages' gradients, the same on every rank (the logging rank is stage 0's);
    # one profiler trace per rank of the first step
    assert [("noise_scale" in r) for r in train[:3]] == [False, False, True]
    assert all(math.isfinite(r["noise_scale"]) for r in train[2:])
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "logs" / "profile").glob("*.pt.trace.json")) == \
        ["rank0", "rank1"]
    run.launch(train_iters=14, override_lr_scheduler=True, profile=False, profile_step_start=10,
               profile_step_stop=12)
    run.assert_ok()
    assert max(run.losses()) == 14
    # checkpoint_validation_with_forward_pass through the pipeline engine's evaluation
    assert "reproduces its saved loss" in run.result.stdout + run.result.stderr


def test_deepspeed_scheduler_dict_sets_the_lr_and_resumes_exactly(data, tmp_path):
    """A DeepSpeed `scheduler` dict replaces the built-in schedule: DeepSpeed builds it, the logged lr is the one
    it sets, and it resumes from the checkpoint exactly, attention dropout's masks included. Evaluation also reports the character-level perplexity, and the
    resumed run finds its checkpoint's loss on the fixed sequence again (checkpoint_validation_with_forward_pass).
    The straight run uploads each complete checkpoint to S3 (s3_path; a real S3 server on 127.0.0.1, moto's), in
    chunks of s3_chunk_size, byte-identical (tests/checkpoint/test_s3_upload.py: interruptions and failures)."""
    from megatron.checkpoint.s3_upload import s3_client
    from tests.checkpoint.s3_server import remote_files, s3_server

    peak = TINY_MODEL["optimizer"]["params"]["lr"]
    settings = dict(num_gpus=1, train_iters=8, eval_interval=4, char_level_ppl=True,
                    checkpoint_validation_with_forward_pass=True,
                    attention_dropout=0.1,  # its masks come from the tracker's stream, saved and resumed with the rest
                    lr_decay_style="linear", min_lr=0.0, warmup=0.01,  # the built-in schedule's defaults
                    scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "total_num_steps": 8,
                                                                    "warmup_type": "linear"}})
    straight = TrainingRun(tmp_path / "straight", data, checkpoint_factor=4, **settings)
    with s3_server(smallest_part=1 << 16) as s3_environment:
        os.environ.update(s3_environment)
        try:
            client = s3_client()
            client.create_bucket(Bucket="ckpts")
            straight.launch(extra_env=s3_environment, s3_path="s3://ckpts/straight", s3_chunk_size=1 << 16)
            straight.assert_ok()
            uploaded = remote_files(client, "ckpts", "straight")
            multipart = client.head_object(Bucket="ckpts", Key="straight/global_step8/mp_rank_00_model_states.pt")
        finally:
            for name in s3_environment:
                os.environ.pop(name, None)
    assert uploaded.pop("latest") == b"global_step8"
    for step in (4, 8):
        ckpt = straight.directory / "ckpt" / f"global_step{step}"
        files = sorted(os.path.relpath(os.path.join(root, name), ckpt) for root, _, names in os.walk(ckpt)
                       for name in names)
        assert "COMPLETE" in files and f"global_step{step}/COMPLETE" in uploaded
        for name in files:
            assert uploaded.pop(f"global_step{step}/{name}") == (ckpt / name).read_bytes(), name
        assert re.search(rf"^uploaded checkpoint {ckpt} to s3://ckpts/straight/global_step{step} ",
                         straight.result.stdout, re.M), straight.result.stdout
    assert not uploaded, sorted(uploaded)  # nothing else (no partial, no non-persistent checkpoint)
    assert multipart["ContentLength"] > 1 << 16 and re.fullmatch(r'"\w+-\d+"', multipart["ETag"])  # in parts
    # WarmupDecayLR after optimizer step i (DeepSpeed steps it once per step, from batch iteration 0)
    expected = [peak * (i / 3 if i < 3 else (8 - i) / 5) for i in range(8)]
    assert [r["lr"] for r in straight.records()] == pytest.approx(expected, rel=1e-6, abs=1e-12)
    evals = straight.records("eval")
    assert evals and all(1.0 < e["lm_loss_char_lvl_ppl"] < e["lm_loss_ppl"] for e in evals)
    # the checkpoint at 4 is written by checkpoint_factor at an evaluation step (issue 19: it used to record
    # consumed_valid_samples before that evaluation, and the resumed run replayed the wrong validation batches)
    resumed = straight.resumed_from(4, tmp_path / "resumed")
    resumed.launch()
    resumed.assert_ok()
    # the runs say what they did (issue 31): each save, the resume, a summary; and nothing of DeepSpeed's launcher
    ckpt, again = tmp_path / "straight" / "ckpt", tmp_path / "resumed" / "ckpt"
    for step in (4, 8):
        assert re.search(rf"^saved checkpoint {ckpt}/global_step{step} \(iteration {step}\) in [\d.]+ s, [\d.]+ "
                         rf"[KM]iB$", straight.result.stdout, re.M), straight.result.stdout
    assert f"resumed from checkpoint {ckpt}/global_step4: iteration 4, 16 training samples consumed (8 validation)" \
        in resumed.result.stdout
    assert re.search(r"^run summary: finished at iteration 8 \(4 iterations run, from 4\), wall time [\d.]+ s, "
                     r"[\d,]+ tokens/s", resumed.result.stdout, re.M), resumed.result.stdout
    assert f"checkpoint {again}/global_step8; metrics {tmp_path / 'resumed' / 'logs' / 'metrics.jsonl'}" in \
        resumed.result.stdout
    for output in (straight.result.stdout + straight.result.stderr, resumed.result.stdout + resumed.result.stderr):
        assert not re.search(r"\[(runner|launch|real_accelerator)\.py:|Unable to find hostfile|exits with", output)
    assert "reproduces its saved loss" in resumed.result.stdout + resumed.result.stderr
    losses = straight.losses()
    assert resumed.losses() == {i: losses[i] for i in range(5, 9)}
    assert resumed.records("eval") == [e for e in evals if e["iteration"] > 4]  # validation, too, is exact
    assert [r["lr"] for r in resumed.records()] == pytest.approx(expected[-4:], rel=1e-6)


def test_metrics_tensorboard_debug_values_epochs_and_eval_tasks(data, tmp_path):
    """One launch: the metrics, tensorboard, debug values, training by epochs, and lm-eval tasks (local YAML tasks,
    offline) run at every evaluation."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron.neox_arguments import NeoXArgs
    from megatron.training_schedule import iterations_for_epochs
    from tests.evaluation.local_tasks import write_local_tasks

    tasks = write_local_tasks(tmp_path / "tasks", docs=4)
    run = TrainingRun(tmp_path, data, num_gpus=1, train_epochs=1, eval_interval=10, split="4,90,6",
                      tensorboard_dir=str(tmp_path / "tb"), save=None, load=None, log_grad_norm=True,
                      log_param_norm=True, memory_profiling=True, log_gradient_noise_scale=True,
                      gradient_noise_scale_n_batches=2, profile=True, profile_step_start=1, profile_step_stop=2,
                      eval_tasks=[str(tasks["neox_mc_local"]), str(tasks["neox_ll_local"])])
    expected_iters = iterations_for_epochs(NeoXArgs.from_dict(run.config))
    run.launch(extra_env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                          "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache")})
    run.assert_ok()
    task_records = run.records("eval_tasks")
    assert [r["iteration"] for r in task_records] == list(range(10, expected_iters + 1, 10))
    assert any(k.startswith("neox_mc_local/acc") for k in task_records[0])
    assert all(0.0 <= v <= 1.0 for k, v in task_records[-1].items() if k.startswith("neox_mc_local/acc"))
    train = run.records("train")
    assert [r["iteration"] for r in train] == list(range(1, expected_iters + 1))
    for key in ("lm_loss", "lr", "grad_norm", "tokens_per_sec", "samples_per_sec", "tflops", "mfu",
                "grad_norm_total", "param_norm_total"):
        assert key in train[0], key
    assert train[-1]["grad_norm"] == pytest.approx(train[-1]["grad_norm_total"], rel=1e-4)
    assert train[-1]["tokens_per_sec"] > 0
    assert (tmp_path / "logs" / "memory" / "memory_iter1.json").is_file()
    # log_gradient_noise_scale: from the first window of two steps on
    assert "noise_scale" not in train[0] and all(math.isfinite(r["noise_scale"]) for r in train[1:])
    # profile: torch.profiler's trace of the steps logged as iterations 2 and 3, one file for the one rank
    [trace] = (tmp_path / "tb" / "profile").glob("rank0.*.pt.trace.json")
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert len({n for n in names if n.startswith("ProfilerStep#")}) == 2
    evals = run.records("eval")
    assert [e["iteration"] for e in evals][:2] == [10, 20]
    events = [f for f in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert any("loss" in tag for tag in acc.Tags()["scalars"])


@pytest.mark.fault
@pytest.mark.attack("SIGTERM to deepy.py alone, to leave the ranks training orphaned")
def test_sigterm_to_deepy_alone_reaches_every_rank_which_saves_and_exits_interrupted(data, tmp_path):
    """SIGTERM to deepy.py only (not its process group): it passes the signal to both ranks, which save a
    checkpoint; deepy.py waits for them and exits 143 (interrupted), leaving no process behind (issue 19)."""
    import yaml

    from megatron.launch.signals import signal_targets

    run = TrainingRun(tmp_path, data, num_gpus=2, train_iters=100000)
    config = tmp_path / "sigterm.yml"
    config.write_text(yaml.safe_dump(run.config))
    log = tmp_path / "deepy.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "deepy.py", "train.py", str(config), "--master_port",
                                 str(free_port())], cwd=REPO, env=deepy_environment(), stdout=out,
                                stderr=subprocess.STDOUT)
    metrics = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.is_file() or metrics.read_text().count("\n") < 3):
        time.sleep(0.5)
        assert proc.poll() is None, log.read_text()
    ranks = signal_targets(proc.pid)
    assert len(ranks) == 2 and all("train.py" in " ".join(r.cmdline()) for r in ranks)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    output = log.read_text()
    assert proc.returncode == 143, output
    assert not [r for r in ranks if r.is_running() and r.status() != "zombie"]
    latest = run.latest()
    assert latest is not None and int(latest[len("global_step"):]) >= 3
    assert "SIGTERM" in output and "saved a checkpoint" in output
    # one last line says it was a stop, with its checkpoint (not DeepSpeed's "[ERROR] ... exits with return code")
    assert output.rstrip().splitlines()[-1] == (
        f"deepy.py: train.py stopped by SIGTERM: saved checkpoint {tmp_path / 'ckpt' / latest} (iteration "
        f"{latest[len('global_step'):]}); run the same command to resume (exit status 143)"), output[-3000:]
    assert "exits with return code" not in output and "[ERROR]" not in output
    assert f"run summary: stopped by SIGTERM at iteration {latest[len('global_step'):]}" in output


def test_megatron_schedules_batch_rampup_train_samples_and_exit_duration_resume(data, tmp_path):
    """rampup_batch_size [4, 4, 24] toward 12 (micro batch 4, 3 micro-batches at full size) with train_samples=76:
    batches 4, 4, 4, 8, 8, then 12 until 76 samples (9 iterations), logged as batch_size. wsd with lr_warmup_iters,
    decoupled_lr and a weight-decay ramp run under DeepSpeed, the schedule advancing by samples (it = samples / 12,
    decay over ceil(76 / 12) = 7 full batches). exit_duration_in_mins stops after the first iteration, mid-ramp,
    with a checkpoint; the relaunch resumes there with the same batches and the closed-form rates."""
    peak, floor = TINY_MODEL["optimizer"]["params"]["lr"], TINY_MODEL["min_lr"]
    run = TrainingRun(tmp_path, data, num_gpus=1, gradient_accumulation_steps=3, train_samples=76,
                      rampup_batch_size=[4, 4, 24], warmup=0.01, lr_warmup_iters=2, lr_decay_style="wsd",
                      lr_wsd_decay_iters=3, lr_wsd_decay_style="linear", decoupled_lr=1e-3,
                      start_weight_decay=0.0, end_weight_decay=0.1, weight_decay_incr_style="linear")
    run.launch(exit_duration_in_mins=1e-9)
    run.assert_ok()
    assert "exit_duration_in_mins=1e-09 passed: saved a checkpoint at iteration 1" in run.result.stdout
    assert run.latest() == "global_step1" and list(run.losses()) == [1]
    run.launch(non_persistent_save_interval=2, non_persistent_ckpt_type="global")
    run.assert_ok()
    assert "batch_size 8" in run.result.stdout
    # Megatron-LM's non-persistent checkpoints, saved at 2, 4, 6 and 8 by the loop: only the newest is kept
    non_persistent = os.path.join(run.config["save"], "non_persistent")
    assert sorted(os.listdir(non_persistent)) == [".non_persistent_checkpoints", "global_step8", "latest"]
    assert os.path.isfile(os.path.join(non_persistent, "global_step8", "COMPLETE"))
    assert run.latest() == "global_step9"
    records = {r["iteration"]: r for r in run.records()}  # the resumed run's records win
    batches = [4, 4, 4, 8, 8, 12, 12, 12, 12]
    assert sorted(records) == list(range(1, 10)) and [records[i]["batch_size"] for i in range(1, 10)] == batches

    def wsd(it: float) -> float:  # W = 2, T = 7, decay over the last 3
        if it <= 2:
            return peak * max(it, 1) / 2
        return peak if it <= 4 else floor + (peak - floor) * (1 - (min(it, 7) - 4) / 3)

    consumed = [sum(batches[:i]) for i in range(1, 10)]  # the rate logged at iteration i is that after its step
    assert [records[i]["lr"] for i in range(1, 10)] == pytest.approx([wsd(c / 12) for c in consumed], rel=1e-6)
    assert falls(run.losses(), by=0.05)


FAKE_AUTORESUME = '''"""A stand-in for NVIDIA's ADLR userlib.auto_resume: rank 1 hears the termination request at its second question,
rank 0 never; every call is written to calls.log beside userlib/."""
import os

LOG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "calls.log")


def _log(event):
    with open(LOG, "a") as handle:
        handle.write(f"{os.environ['RANK']} {event}\\n")


class AutoResume:
    asked = 0

    @staticmethod
    def init():
        _log("init")

    @classmethod
    def termination_requested(cls):
        cls.asked += 1
        _log(f"termination_requested {cls.asked}")
        return os.environ["RANK"] == "1" and cls.asked == 2

    @staticmethod
    def request_resume():
        _log("request_resume")
'''


def test_adlr_autoresume_saves_and_requests_resume_when_the_scheduler_asks(data, tmp_path):
    """adlr_autoresume as GPT-NeoX runs it, against a stand-in userlib found through SUBMIT_SCRIPTS: every rank
    initialises it and asks every adlr_autoresume_interval iterations; one rank's yes (rank 1's, at iteration 4)
    stops both with a checkpoint, rank 0 alone requests the resubmission, and the run exits 0 saying why."""
    scripts = tmp_path / "submit_scripts"
    (scripts / "userlib").mkdir(parents=True)
    (scripts / "userlib" / "__init__.py").write_text("")
    (scripts / "userlib" / "auto_resume.py").write_text(FAKE_AUTORESUME)
    run = TrainingRun(tmp_path / "run", data, num_gpus=2, train_iters=8, checkpoint_factor=100,
                      adlr_autoresume=True, adlr_autoresume_interval=2)
    run.launch(extra_env={"SUBMIT_SCRIPTS": str(scripts)})
    run.assert_ok()
    assert run.latest() == "global_step4" and max(run.losses()) == 4
    assert (f"adlr_autoresume: the cluster's scheduler asked the job to end (AutoResume.termination_requested at "
            f"iteration 4): saved a checkpoint at iteration 4 in {tmp_path / 'run' / 'ckpt'}; resume requested, "
            f"exiting") in run.result.stdout
    calls = sorted((scripts / "calls.log").read_text().splitlines())
    assert calls == sorted(["0 init", "1 init", "0 termination_requested 1", "1 termination_requested 1",
                            "0 termination_requested 2", "1 termination_requested 2", "0 request_resume"])
    # without the library the run is refused at start, naming the key and the variable
    run.launch(extra_env={"SUBMIT_SCRIPTS": str(tmp_path / "nowhere")})
    assert run.result.returncode != 0
    output = run.result.stdout + run.result.stderr
    assert "adlr_autoresume: true needs NVIDIA's ADLR cluster library userlib.auto_resume" in output
    assert f"SUBMIT_SCRIPTS='{tmp_path / 'nowhere'}'" in output and "Traceback" not in output
