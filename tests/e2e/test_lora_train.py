"""LoRA through deepy.py (megatron.model.lora, megatron.checkpoint.lora): adapters start on a base checkpoint, only
they train, the checkpoints hold the adapters (and their optimizer state) with a pointer to the base, and a run
resumed from one gives the losses of the run that did not stop (fp32)."""

import pytest
import torch

from megatron.checkpoint.files import load_checkpoint_file, read_client_state
from megatron.checkpoint.neox_checkpoint import read_checkpoint
from tests.e2e.training_run import TrainingRun, build_tiny_corpus
from tests.tools.tool_runner import load_tool

merge_lora = load_tool("tools/ckpts/merge_lora.py")

pytestmark = pytest.mark.slow

PIPE = {"pipe_parallel_size": 1}
"""GPT-NeoX's default: a PipelineModule of one stage, whose checkpoints are layer files (the doc's LoRA example
trains without a pipeline, at tensor parallel 2)."""
LORA = {"r": 4, "alpha": 8, "target_modules": ["query_key_value", "dense", "linear1", "linear2"]}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A base checkpoint (one step of full training, without a pipeline) and a LoRA run of 6 steps on it without
    ZeRO in a one-stage pipeline (the base resharded as it loads), saving at 3: (the LoRA run, the base's save
    directory)."""
    tmp_path = tmp_path_factory.mktemp("lora")
    data = build_tiny_corpus(tmp_path / "corpus", num_files=20)
    base = TrainingRun(tmp_path / "base", data, num_gpus=1, train_iters=1, checkpoint_factor=1, load=None,
                       pipe_parallel_size=0)
    base.launch()
    base.assert_ok()
    base_dir = tmp_path / "base" / "ckpt"
    straight = TrainingRun(tmp_path / "straight", data, num_gpus=1, train_iters=6, checkpoint_factor=3,
                           load=str(base_dir), finetune=True, lora=LORA, **PIPE)
    straight.launch()
    straight.assert_ok()
    assert f"note: base checkpoint {base_dir}/global_step1 was saved with model_parallel_size 1 and " \
           f"pipe_parallel_size 0; resharding its weights for this run's 1 and 1" in straight.result.stdout
    return straight, base_dir


def test_lora_trains_saves_adapters_only_and_resumes_exactly(lora_run, tmp_path):
    straight, base_dir = lora_run
    losses = straight.losses()
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], losses

    ckpt = straight.directory / "ckpt" / "global_step3"
    weights = load_checkpoint_file(str(ckpt / "mp_rank_00_model_states.pt"))
    tensors = _adapter_tensors(ckpt)
    names = list(tensors)
    assert names and all(".lora.lora_" in n for n in names), names
    assert all(t.abs().sum() > 0 for n, t in tensors.items() if n.endswith("lora_B"))  # they trained
    assert len(names) == 2 * 2 * 4  # two layers x four targets x (A, B)
    pointer = read_client_state(str(ckpt))["lora_base"]
    assert pointer["load"] == str(base_dir) and pointer["tag"] == "global_step1" and pointer["manifest_digest"]
    moments = [t for t in _tensors(weights["optimizer"]) if t.dim()]  # without ZeRO: in the mp_rank file
    assert sorted(t.shape for t in moments) == sorted(2 * [t.shape for t in tensors.values()])  # Adam's two each

    resumed = straight.resumed_from(3, tmp_path / "resumed", finetune=False)
    resumed.launch()
    resumed.assert_ok()
    assert {it: loss for it, loss in resumed.losses().items() if it > 3} == \
        {it: loss for it, loss in losses.items() if it > 3}
    assert "resumed from checkpoint" in resumed.result.stdout

    # tools/ckpts/merge_lora.py on the trained adapters: a full checkpoint whose adapted weights moved, the rest the base's
    assert merge_lora.main(["--input_dir", str(straight.directory / "ckpt"), "--output_dir",
                            str(tmp_path / "merged")]) == 0
    merged, base_state = read_checkpoint(str(tmp_path / "merged")), read_checkpoint(str(base_dir)).state
    assert merged.path.endswith("global_step6") and set(merged.state) == set(base_state)
    moved = {name for name in base_state if not torch.equal(merged.state[name], base_state[name])}
    assert moved == {f"layers.{i}.{t}.weight" for i in (0, 1) for t in ("attention.query_key_value", "attention.dense",
                                                                        "mlp.linear1", "mlp.linear2")}


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_under_zero_gives_the_losses_of_zero_0_and_resumes_exactly(lora_run, tmp_path, stage):
    """ZeRO 2 / 3 on two data-parallel ranks (micro-batches of 2: the same global batch of 4 as the run without ZeRO
    on one rank), without a pipeline (under ZeRO-3 the base loads into its partitions): the same losses as that run, checkpoints of the adapters only (their optimizer
    partitions too), a resume from one gives the losses of the run that did not stop, and merge_lora.py gives the
    weights the run without ZeRO merges to."""
    straight, base_dir = lora_run
    zero = TrainingRun(tmp_path / "zero", {}, **{**straight.config, "num_gpus": 2, "train_micro_batch_size_per_gpu": 2,
                                                  "zero_optimization": {"stage": stage}, "pipe_parallel_size": 0,
                                                  "save": str(tmp_path / "zero" / "ckpt"),
                                                  "log_dir": str(tmp_path / "zero" / "logs")})
    zero.launch()
    zero.assert_ok()
    without, with_zero = straight.losses(), zero.losses()
    print(f"losses without ZeRO (1 rank): {without}\nwith ZeRO {stage} (2 ranks): {with_zero}")
    assert sorted(with_zero) == sorted(without)
    assert all(abs(with_zero[i] - without[i]) <= 1e-5 * abs(without[i]) for i in without), (without, with_zero)

    ckpt = tmp_path / "zero" / "ckpt" / "global_step3"
    module = load_checkpoint_file(str(ckpt / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else
                                              "mp_rank_00_model_states.pt")))["module"]
    assert len(module) == 2 * 2 * 4 and all(".lora.lora_" in n for n in module), list(module)
    optim = [load_checkpoint_file(str(ckpt / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")) for r in (0, 1)]
    partitions = [o["optimizer_state_dict"]["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"]
                  for o in optim]
    adapters = sum(t.numel() for t in _adapter_tensors(straight.directory / "ckpt" / "global_step3").values())
    assert sum(t.numel() for part in partitions for t in part) == adapters  # the adapters' fp32 weights, halved
    assert read_client_state(str(ckpt))["lora_base"]["load"] == str(base_dir)

    resumed = zero.resumed_from(3, tmp_path / "resumed", finetune=False)
    resumed.launch()
    resumed.assert_ok()
    assert {it: loss for it, loss in resumed.losses().items() if it > 3} == \
        {it: loss for it, loss in with_zero.items() if it > 3}

    for name, run in (("without", straight.directory), ("with", tmp_path / "zero")):
        assert merge_lora.main(["--input_dir", str(run / "ckpt"), "--output_dir", str(tmp_path / name)]) == 0
    merged, expected = read_checkpoint(str(tmp_path / "with")).state, read_checkpoint(str(tmp_path / "without")).state
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_lora_in_a_two_stage_pipeline_gives_one_stages_losses_resumes_and_merges(lora_run, tmp_path):
    """Pipeline parallel 2 (each stage adapts its own layers, checkpoints of the adapters in per-layer files; each
    stage takes its layers of the base saved without a pipeline): the losses of the one-stage run on the same base,
    an exact resume, and merge_lora.py gives the one-stage run's merged weights to fp32 precision."""
    straight, base_dir = lora_run
    piped = TrainingRun(tmp_path / "pp2", {}, **{**straight.config, "num_gpus": 2, "pipe_parallel_size": 2,
                                                  "save": str(tmp_path / "pp2" / "ckpt"),
                                                  "log_dir": str(tmp_path / "pp2" / "logs")})
    piped.launch()
    piped.assert_ok()
    assert "pipe_parallel_size 0; resharding its weights for this run's 1 and 2" in piped.result.stdout
    one, two = straight.losses(), piped.losses()
    print("losses, one stage:", one, "\ntwo stages:", two)
    assert sorted(two) == sorted(one) and all(abs(two[i] - one[i]) <= 1e-5 * abs(one[i]) for i in one), (one, two)
    assert len(_adapter_tensors(tmp_path / "pp2" / "ckpt" / "global_step3")) == 2 * 2 * 4

    resumed = piped.resumed_from(3, tmp_path / "resumed", finetune=False)
    resumed.launch()
    resumed.assert_ok()
    assert {it: loss for it, loss in resumed.losses().items() if it > 3} == {it: two[it] for it in (4, 5, 6)}

    for name, run in (("one", straight.directory), ("two", tmp_path / "pp2")):
        assert merge_lora.main(["--input_dir", str(run / "ckpt"), "--output_dir", str(tmp_path / name)]) == 0
    merged_one, merged_two = read_checkpoint(str(tmp_path / "one")).state, read_checkpoint(str(tmp_path / "two")).state
    for name, value in merged_one.items():
        torch.testing.assert_close(merged_two[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _adapter_tensors(ckpt):
    """The tensors of a checkpoint's model files (the mp_rank file's module, or a pipeline's layer files)."""
    tensors = dict(load_checkpoint_file(str(ckpt / "mp_rank_00_model_states.pt")).get("module") or {})
    for layer in sorted(ckpt.glob("layer_*-model_*-model_states.pt")):
        tensors.update({f"{layer.name}:{n}": t for n, t in load_checkpoint_file(str(layer)).items()})
    return tensors


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
