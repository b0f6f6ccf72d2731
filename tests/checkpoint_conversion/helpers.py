"""Shared pieces of the conversion tests: tiny random Hugging Face models, our model rebuilt from a
converted checkpoint, greedy decoding with our KV cache, and fixed token batches."""
from __future__ import annotations

import os
from typing import Mapping

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
SEQ = 32


def tiny_gptneox(parallel_residual: bool = True, rotary_pct: float = 0.5, tied: bool = False, seed: int = 0,
                 attention_bias: bool = True, rope=None, positions: int = SEQ):
    """A random 2-layer GPTNeoXForCausalLM (hidden 32, 4 heads, vocab 96) with non-trivial norms and biases;
    ``rope``: RoPE scaling parameters (rope_type ...)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, hidden_act="gelu", max_position_embeddings=positions,
                           rope_parameters={"rope_type": "default", **(rope or {}), "rope_theta": 10000.0,
                                            "partial_rotary_factor": rotary_pct},
                           use_parallel_residual=parallel_residual, tie_word_embeddings=tied,
                           attention_bias=attention_bias, layer_norm_eps=1e-5, bos_token_id=None, eos_token_id=None)
    return _randomise(GPTNeoXForCausalLM(config).eval())


def tiny_llama(kv_heads: int = 2, tied: bool = False, seed: int = 0, mistral_window=None, bias: bool = False,
               rope=None):
    """A random 2-layer LlamaForCausalLM (or MistralForCausalLM with ``mistral_window``) with GQA; ``rope``:
    RoPE scaling parameters (rope_type ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, intermediate_size=48, max_position_embeddings=SEQ,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", **(rope or {}), "rope_theta": 10000.0},
                  tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None)
    if mistral_window is not None:
        return _randomise(MistralForCausalLM(MistralConfig(**common, sliding_window=mistral_window)).eval())
    return _randomise(LlamaForCausalLM(LlamaConfig(**common, attention_bias=bias, mlp_bias=bias)).eval())


def tiny_qwen2(kv_heads: int = 2, tied: bool = True, seed: int = 0, rope=None):
    """A random 2-layer Qwen2ForCausalLM with GQA (biases on q, k and v only; tied embeddings as Qwen2.5's small
    models)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, intermediate_size=48, max_position_embeddings=SEQ,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", **(rope or {}),
                                                             "rope_theta": 10000.0},
                         tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None)
    return _randomise(Qwen2ForCausalLM(config).eval())


def tiny_olmo(kv_heads: int = 2, tied: bool = False, seed: int = 0):
    """A random 2-layer OlmoForCausalLM with GQA: LayerNorms without weight or bias (non_parametric_layernorm)."""
    from transformers import OlmoConfig, OlmoForCausalLM

    torch.manual_seed(seed)
    config = OlmoConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=kv_heads, intermediate_size=48, max_position_embeddings=SEQ,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=tied,
                        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return _randomise(OlmoForCausalLM(config).eval())


def tiny_mixtral(kv_heads: int = 2, seed: int = 0, top_k: int = 2):
    """A random 2-layer MixtralForCausalLM: 4 experts of width 24, top-k routing, GQA; a sharp router (its
    top-k choices well apart, so float rounding cannot change them)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=kv_heads, intermediate_size=24, max_position_embeddings=SEQ,
                           rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           num_local_experts=4, num_experts_per_tok=top_k, router_aux_loss_coef=0.02,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = _randomise(MixtralForCausalLM(config).eval())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(30.0)
    return model


def sharpened_attention(model, factor: float = 8.0):
    """``model`` with its query / key / value weights times ``factor``: random tiny models attend almost
    uniformly, so a change of rotary frequencies (dynamic RoPE scaling) would move their logits by ~1e-6 only."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("query_key_value.weight", "q_proj.weight", "k_proj.weight")):
                param.mul_(factor)
    return model


def save_tiny_tokenizer(directory) -> None:
    """A word-level tokenizer.json of VOCAB tokens (id 0 is <|endoftext|>) and its tokenizer_config.json."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(directory))


def _randomise(model):
    """Norm weights and biases away from 1 / 0 so a mix-up between tensors would show in the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def our_model(config, state: Mapping[str, torch.Tensor]):
    """GPT2ModelSequential of a checkpoint's ModelConfig, built for one process in fp32 without dropout, with
    the merged ``state`` (the converter's flat names) loaded strictly."""
    from megatron.checkpoint.neox_checkpoint import sequential_state_dict
    from megatron.model.gpt2_model import GPT2ModelSequential
    from megatron.mpu import SingleProcessState

    config = config.replace(
        pipe_parallel_size=0, model_parallel_size=1, sequence_parallel=False, checkpoint_activations=False,
        hidden_dropout=0.0, attention_dropout=0.0, precision="fp32")
    model = GPT2ModelSequential(config, SingleProcessState())
    model.load_state_dict(sequential_state_dict(state, config.num_layers), strict=True)
    return model.eval()


def batch_inputs(tokens: torch.Tensor):
    from megatron.model.batch import masks_and_position_ids

    mask, _, pos = masks_and_position_ids(tokens, None, False)
    return tokens, pos, mask


def our_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(batch_inputs(tokens))


def random_tokens(batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def our_greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with our KV cache: the prompt in one forward, then one token per forward."""
    from megatron.model.kv_cache import KVCache

    cache = KVCache(prompt.size(1) + new_tokens)
    out, step = prompt, prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            pos = torch.arange(cache.length, cache.length + step.size(1)).unsqueeze(0).expand(step.size(0), -1)
            logits = model((step, pos, None), kv_cache=cache)
            step = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat((out, step), dim=1)
    return out


def hf_greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers' greedy generate() for exactly ``new_tokens`` tokens: no eos stop (and no eos
    suppression, which min_new_tokens would add), so it is plain argmax decoding like ``our_greedy``."""
    import copy

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.pad_token_id = 0
    with torch.no_grad():
        return model.generate(prompt, generation_config=config, max_new_tokens=new_tokens, do_sample=False,
                              attention_mask=torch.ones_like(prompt))


def assert_matches_hf(ours, hf, atol: float = 1e-4) -> None:
    """Our model gives transformers' logits (to atol) and its greedy continuation (10 tokens)."""
    tokens = random_tokens(seq=16)
    with torch.no_grad():
        want = hf(tokens).logits
    torch.testing.assert_close(our_logits(ours, tokens), want, rtol=0, atol=atol)
    prompt = tokens[:, :5]
    assert torch.equal(our_greedy(ours, prompt, 10), hf_greedy(hf, prompt, 10))
