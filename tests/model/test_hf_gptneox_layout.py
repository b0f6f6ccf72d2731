"""Our GPT (rotary, partial rotary_pct, GPT-J parallel residual, untied head) loads into Hugging Face
GPTNeoXForCausalLM by renaming alone and gives the same logits: the fused QKV layout (per head
q|k|v) and the rotate-half rotary are Hugging Face's. Needs `transformers` (requirements-transformers)."""
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from tests.model.helpers import random_batch, tiny_config


def _hf_name(ours: str, num_layers: int = 2) -> str:
    """GPT-NeoX's slot names (sequential.{slot}.*) as Hugging Face GPTNeoX names."""
    slot, _, rest = ours[len("sequential."):].partition(".")
    slot = int(slot)
    if slot == 0:
        return "gpt_neox.embed_in." + rest.split(".", 1)[1]
    if slot == num_layers + 4:
        return "embed_out.weight"
    if slot == num_layers + 3:
        return "gpt_neox.final_layer_norm." + rest.rsplit(".", 1)[1]
    name = f"gpt_neox.layers.{slot - 2}.{rest}"
    return name.replace("mlp.linear1", "mlp.dense_h_to_4h").replace("mlp.linear2", "mlp.dense_4h_to_h")


def test_logits_match_hf_gptneox():
    args = tiny_config(pos_emb="rotary", rotary_pct=0.5, gpt_j_residual=True, no_weight_tying=True,
                          max_position_embeddings=16)
    ours = build_model(args, SingleProcessState()).eval()
    config = GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, rotary_pct=0.5, rotary_emb_base=10000,
                           max_position_embeddings=16, layer_norm_eps=1e-5, use_parallel_residual=True,
                           hidden_act="gelu", tie_word_embeddings=False)
    hf = GPTNeoXForCausalLM(config).eval()
    state = {_hf_name(n): p.detach() for n, p in ours.named_parameters()}
    hf_names = {n for n, _ in hf.named_parameters()}
    hf_key = "lm_head.weight" if "lm_head.weight" in hf_names else "embed_out.weight"
    state[hf_key] = state.pop("embed_out.weight")
    assert set(state) == hf_names
    hf.load_state_dict(state, strict=False)
    inputs, _ = random_batch()
    with torch.no_grad():
        want = hf(input_ids=inputs[0]).logits
        got = ours(inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
