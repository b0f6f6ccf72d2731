"""DPO end to end through deepy.py on two CPU ranks (tensor parallel): preference pairs made by the chat-template
tool, a first step where policy == reference (loss ln 2, rewards 0), reward accuracy rising on a separable set,
and an exact resume that compares with the saved reference, not with the resumed policy. A reward model on the
same pairs under ZeRO-3: accuracy rising, its metrics logged, and its export to transformers scoring the same."""

import json
import math

import pytest

from tests.data.chat_helpers import hf_folder
from tests.e2e.training_run import TrainingRun
from tests.tools.tool_runner import load_tool

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "candle", "forest", "rocket", "garden", "silver",
         "winter", "mirror", "castle", "button", "pencil"]
RM_STEPS = 16


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Separable preferences: the chosen answer repeats the word, the rejected one says 'no idea'."""
    directory = tmp_path_factory.mktemp("pairs")
    folder = hf_folder(directory)
    rows = []
    for word in WORDS:
        prompt = [{"role": "user", "content": f"say {word}"}]
        rows.append({"chosen": prompt + [{"role": "assistant", "content": f"{word} {word}"}],
                     "rejected": prompt + [{"role": "assistant", "content": "no idea, sorry"}]})
    (directory / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix = str(directory / "dpo")
    assert load_tool("tools/datasets/preprocess_data_with_chat_template.py").main(
        ["--input", str(directory / "pairs.jsonl"), "--output-prefix", prefix, "--tokenizer-path", str(folder),
         "--jsonl-keys", "chosen", "rejected", "--only-last", "--no-progress"]) == 0
    return {"tokenizer_type": "HFTokenizer", "vocab_file": str(folder / "tokenizer.json"),
            "dataset_impl": "pairwise", "train_impl": "dpo", "pack_impl": "unpacked",
            "pos_train_data_paths": [f"{prefix}_chosen_document"],
            "neg_train_data_paths": [f"{prefix}_rejected_document"],
            "pos_train_label_data_paths": [f"{prefix}_chosen_label_document"],
            "neg_train_label_data_paths": [f"{prefix}_rejected_label_document"]}


def test_dpo_tensor_parallel_learns_the_preference_and_resumes_exactly(pairs, tmp_path):
    run = TrainingRun(tmp_path / "run", pairs, num_gpus=2, model_parallel_size=2, train_iters=8,
                      checkpoint_factor=4, dpo_beta=0.5, train_micro_batch_size_per_gpu=4)
    run.launch()
    run.assert_ok()
    assert "DPO reference model: the policy's weights at the start of the run" in run.result.stdout
    records = run.records()
    first = records[0]
    assert first["iteration"] == 1 and abs(first["lm_loss"] - math.log(2)) < 1e-4
    assert abs(first["chosen_rewards"]) < 1e-6 and abs(first["rejected_rewards"]) < 1e-6
    assert first["reward_accuracy"] == 0.0  # a zero margin is no preference
    last = records[-3:]
    assert sum(r["reward_accuracy"] for r in last) / 3 > 0.9, [r["reward_accuracy"] for r in records]
    assert sum(r["lm_loss"] for r in last) / 3 < math.log(2) - 0.1
    assert all(r["reward_margin"] > 0 and r["chosen_rewards"] > r["rejected_rewards"] for r in last)
    saved = sorted(p.name for p in (tmp_path / "run" / "ckpt" / "global_step4").iterdir())
    assert {"dpo_reference_mp_rank_00.pt", "dpo_reference_mp_rank_01.pt"} <= set(saved)

    resumed = TrainingRun(tmp_path / "resumed", pairs, num_gpus=2, model_parallel_size=2, train_iters=8,
                          checkpoint_factor=4, dpo_beta=0.5, train_micro_batch_size_per_gpu=4,
                          load=str(tmp_path / "run" / "ckpt"), iteration=4)
    resumed.launch()
    resumed.assert_ok()
    assert "DPO reference model: the reference weights saved in" in resumed.result.stdout
    again = resumed.records()
    assert [r["iteration"] for r in again] == list(range(5, 9))
    for before, after in zip(records[4:], again):
        for key in ("lm_loss", "chosen_rewards", "rejected_rewards", "reward_margin"):
            assert after[key] == pytest.approx(before[key], abs=1e-6), (key, before, after)


def test_reward_model_under_zero3_learns_the_preference_and_exports_to_transformers(pairs, tmp_path):
    """One launch: a reward model (train_impl rm) on two data-parallel ranks under ZeRO-3 logs its metrics, its
    pairwise accuracy rises above 0.9, and its checkpoint converts to a GPTNeoXForSequenceClassification that
    scores every conversation as the checkpoint's own model does."""
    import torch
    from transformers import GPTNeoXForSequenceClassification

    from megatron.checkpoint.neox_checkpoint import read_checkpoint
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.inference.loading import load_model_weights
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState
    from tests.checkpoint_conversion.helpers import batch_inputs

    run = TrainingRun(tmp_path / "run", {**pairs, "train_impl": "rm"}, num_gpus=2, pipe_parallel_size=0,
                      zero_optimization={"stage": 3}, train_iters=RM_STEPS, checkpoint_factor=RM_STEPS,
                      train_micro_batch_size_per_gpu=4, lr_decay_style="constant", warmup=0.0,
                      optimizer={"type": "Adam", "params": {"lr": 5.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8}})
    run.launch()
    run.assert_ok()
    records = run.records()
    assert [r["iteration"] for r in records] == list(range(1, RM_STEPS + 1))
    assert all({"lm_loss", "chosen_rewards", "rejected_rewards", "reward_accuracy", "reward_margin"} <= set(r)
               for r in records)
    last = records[-4:]
    assert sum(r["reward_accuracy"] for r in last) / 4 > 0.9, [r["reward_accuracy"] for r in records]
    assert sum(r["lm_loss"] for r in last) / 4 < records[0]["lm_loss"] - 0.3

    checkpoint = tmp_path / "run" / "ckpt" / f"global_step{RM_STEPS}"
    assert load_tool("tools/ckpts/convert_neox_to_hf.py").main(
        ["--input_dir", str(checkpoint), "--output_dir", str(tmp_path / "hf")]) == 0
    hf = GPTNeoXForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    config = read_checkpoint(str(checkpoint)).config
    ours = build_model(config, SingleProcessState()).eval()
    load_model_weights(ours, str(checkpoint), SingleProcessState(), config)
    scores = {}
    for kind in ("pos", "neg"):
        texts = MMapIndexedDataset(pairs[f"{kind}_train_data_paths"][0])
        labels = MMapIndexedDataset(pairs[f"{kind}_train_label_data_paths"][0])
        scores[kind] = []
        limit = run.config["seq_length"] + 1  # samples are cut to seq_length + 1 tokens (allow_chopped)
        for i in range(len(texts)):  # scored at the input position whose label is the last one trained on
            end = int(max(j for j, label in enumerate(labels[i][:limit]) if label != -100))
            tokens = torch.as_tensor(texts[i][:end].astype("int64")).unsqueeze(0)
            with torch.no_grad():
                score, want = float(hf(tokens).logits), float(ours(batch_inputs(tokens))[0, -1, 0])
            assert score == pytest.approx(want, abs=1e-4)
            scores[kind].append(score)
    assert sum(c > r for c, r in zip(scores["pos"], scores["neg"])) / len(WORDS) > 0.9


def test_lora_dpo_uses_the_base_as_reference_and_trains_the_adapters(pairs, tmp_path):
    """DPO with LoRA adapters at tensor parallel 2 on a base checkpoint saved at 1: the reference is the base itself (the
    policy with its adapters off: no reference copy, none saved), the first step has loss ln 2, the preference is
    learnt, and the checkpoints hold the adapters only (their resume is test_lora_train's: the reference, being the
    base, needs nothing of its own)."""
    from megatron.checkpoint.files import load_checkpoint_file

    common = dict(num_gpus=2, model_parallel_size=2, dpo_beta=0.5, train_micro_batch_size_per_gpu=4)
    base = TrainingRun(tmp_path / "base", pairs, train_iters=1, checkpoint_factor=1, load=None,
                       **{**common, "num_gpus": 1, "model_parallel_size": 1})  # resharded to TP 2 as it loads
    base.launch()
    base.assert_ok()
    lora = {"r": 4, "alpha": 16, "target_modules": ["query_key_value", "dense", "linear1", "linear2"]}
    run = TrainingRun(tmp_path / "run", pairs, train_iters=8, checkpoint_factor=4, load=str(tmp_path / "base" / "ckpt"),
                      finetune=True, lora=lora, **common)
    run.launch()
    run.assert_ok()
    assert "DPO reference model: the base model (the policy with its LoRA adapters off)" in run.result.stdout
    records = run.records()
    assert abs(records[0]["lm_loss"] - math.log(2)) < 1e-6 and records[0]["reward_margin"] == 0.0
    last = records[-3:]
    assert sum(r["reward_accuracy"] for r in last) / 3 > 0.9, [r["reward_accuracy"] for r in records]
    assert sum(r["lm_loss"] for r in last) / 3 < math.log(2) - 0.1
    ckpt = tmp_path / "run" / "ckpt" / "global_step4"
    assert not list(ckpt.glob("dpo_reference_*"))
    for rank in (0, 1):
        module = load_checkpoint_file(str(ckpt / f"mp_rank_0{rank}_model_states.pt"))["module"]
        assert len(module) == 2 * 2 * 4 and all(".lora.lora_" in name for name in module), list(module)
