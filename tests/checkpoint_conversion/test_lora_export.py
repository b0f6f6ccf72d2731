"""A LoRA adapter checkpoint taken out (megatron.checkpoint_conversion.lora, tools/ckpts/merge_lora.py and
export_lora_to_peft.py), with transformers and peft as the oracles: a tiny Hugging Face model converted in at tensor
parallel 2 is the base; LoRA adapters (random A and B, so that the update matters) on it are saved as a LoRA run saves
them, split over two tensor-parallel ranks; merged into the base they give the LoRA model's logits, and exported as a
peft adapter, ``PeftModel.from_pretrained`` on the base converted back to Hugging Face gives them too (<= 1e-4)."""
import json

import pytest
import torch

from megatron.checkpoint.engine import FoundCheckpoint
from megatron.checkpoint.format import LORA_BASE_KEY
from megatron.checkpoint.lora import base_pointer
from megatron.checkpoint.neox_checkpoint import flat_state_dict, read_checkpoint, sequential_state_dict, write_checkpoint
from megatron.checkpoint_conversion.from_hf import convert_hf_to_neox
from megatron.checkpoint_conversion.to_hf import convert_neox_to_hf
from megatron.inference.loading import load_model_weights
from megatron.model.gpt2_model import GPT2ModelSequential
from megatron.model.lora import is_lora_parameter
from megatron.mpu import SingleProcessState
from tests.checkpoint_conversion.helpers import (our_logits, our_model, random_tokens, tiny_gptneox, tiny_llama,
                                                tiny_qwen2)
from tests.tools.tool_runner import load_tool

merge_lora = load_tool("tools/ckpts/merge_lora.py")
export_lora_to_peft = load_tool("tools/ckpts/export_lora_to_peft.py")

FAMILIES = {
    "neox": (lambda: tiny_gptneox(rotary_pct=1.0), dict(r=4, alpha=8, target_modules=[
        "query_key_value", "dense", "linear1", "linear2"])),
    "llama": (lambda: tiny_llama(kv_heads=2), dict(r=4, alpha=16, target_modules=[
        "query_key_value", "dense", "linear1", "linear2"], layers_to_transform=[1])),
    "qwen2": (lambda: tiny_qwen2(kv_heads=2), dict(r=2, alpha=4, target_modules=["query_key_value", "linear1"])),
}


def _lora_model(config, state):
    """Our model with the adapters of ``config.lora`` on base ``state``, A and B random."""
    config = config.replace(pipe_parallel_size=0, model_parallel_size=1, hidden_dropout=0.0, attention_dropout=0.0,
                            precision="fp32")
    model = GPT2ModelSequential(config, SingleProcessState())
    from megatron.model.lora import apply_lora
    apply_lora(model, config, SingleProcessState())
    result = model.load_state_dict(sequential_state_dict(state, config.num_layers), strict=False)
    assert result.missing_keys and all(is_lora_parameter(n) for n in result.missing_keys), result
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_lora_parameter(name):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_and_peft_exported_adapters_give_the_lora_models_logits(family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    make, lora = FAMILIES[family]
    make().save_pretrained(tmp_path / "hf")
    convert_hf_to_neox(str(tmp_path / "hf"), str(tmp_path / "base"), str(tmp_path / "base.yml"), 2)
    base = read_checkpoint(str(tmp_path / "base"))
    config = base.config.replace(lora=lora)
    model = _lora_model(config, base.state)
    adapters = {name: t for name, t in flat_state_dict(model.state_dict(), config).items() if is_lora_parameter(name)}
    pointer = base_pointer(FoundCheckpoint(str(tmp_path / "base"), "global_step0", "ours"))
    write_checkpoint(str(tmp_path / "adapters"), adapters, config.replace(model_parallel_size=2),
                     {**base.args, "lora": lora}, {}, iteration=7, client_state={LORA_BASE_KEY: pointer})
    tokens = random_tokens(seq=16)
    want = our_logits(model, tokens)
    assert not torch.allclose(want, our_logits(our_model(base.config, base.state), tokens), atol=1e-3)

    assert merge_lora.main(["--input_dir", str(tmp_path / "adapters"), "--output_dir", str(tmp_path / "merged")]) == 0
    merged = read_checkpoint(str(tmp_path / "merged"))
    assert merged.path.endswith("global_step7") and merged.layout == (2, 0) and "lora" not in merged.args
    torch.testing.assert_close(our_logits(our_model(merged.config, merged.state), tokens), want, rtol=0, atol=1e-5)

    # generate.py / eval.py load the adapter checkpoint as the base with the adapters merged in, at any split
    plain_config = base.config.replace(model_parallel_size=1, pipe_parallel_size=0, precision="fp32",
                                       hidden_dropout=0.0, attention_dropout=0.0)
    plain = GPT2ModelSequential(plain_config, SingleProcessState())
    load_model_weights(plain, str(tmp_path / "adapters"), SingleProcessState(), plain_config)
    torch.testing.assert_close(our_logits(plain.eval(), tokens), want, rtol=0, atol=1e-5)

    convert_neox_to_hf(str(tmp_path / "base"), str(tmp_path / "hf_base"), architecture=family)
    assert export_lora_to_peft.main(["--input_dir", str(tmp_path / "adapters"), "--output_dir",
                                     str(tmp_path / "peft"), "--architecture", family]) == 0
    settings = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert settings["r"] == lora["r"] and settings["lora_alpha"] == lora["alpha"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_base", local_files_only=True)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    with torch.no_grad():
        got = peft_model(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_full_checkpoint_is_not_an_adapter_checkpoint(tmp_path, capsys):
    tiny_llama().save_pretrained(tmp_path / "hf")
    convert_hf_to_neox(str(tmp_path / "hf"), str(tmp_path / "base"), str(tmp_path / "base.yml"))
    assert merge_lora.main(["--input_dir", str(tmp_path / "base"), "--output_dir", str(tmp_path / "m")]) == 2
    assert "is not a LoRA run's adapter checkpoint" in capsys.readouterr().err


def test_a_rewritten_base_is_refused_by_the_tools(tmp_path, capsys):
    tiny_llama().save_pretrained(tmp_path / "hf")
    convert_hf_to_neox(str(tmp_path / "hf"), str(tmp_path / "base"), str(tmp_path / "base.yml"))
    base = read_checkpoint(str(tmp_path / "base"))
    lora = dict(r=2, alpha=2)
    config = base.config.replace(lora=lora)
    adapters = {n: t for n, t in flat_state_dict(_lora_model(config, base.state).state_dict(), config).items()
                if is_lora_parameter(n)}
    pointer = base_pointer(FoundCheckpoint(str(tmp_path / "base"), "global_step0", "ours"))
    write_checkpoint(str(tmp_path / "adapters"), adapters, config, {**base.args, "lora": lora}, {},
                     client_state={LORA_BASE_KEY: {**pointer, "manifest_digest": "0" * 32}})
    assert merge_lora.main(["--input_dir", str(tmp_path / "adapters"), "--output_dir", str(tmp_path / "m")]) == 2
    assert "is not the one adapter checkpoint" in capsys.readouterr().err
