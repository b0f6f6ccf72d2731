#!/usr/bin/env python
"""The contenders the training benchmarks compare this project against, one per process:

    hf       Hugging Face transformers' GPTNeoXForCausalLM (SDPA attention) with torch.optim.AdamW, the loop a
             user writes by hand;
    torch    a minimal GPT in plain PyTorch (fused QKV, partial rotary, SDPA causal attention, parallel
             residual, fused AdamW): the practical limit for this model on this machine;
    mixtral  transformers' MixtralForCausalLM (random weights from a MixtralConfig: SwiGLU experts, top-k router,
             its load-balancing loss at coefficient 0.01, transformers' default experts implementation) with
             torch.optim.AdamW(fused=True), for bench/moe_throughput.py; the shape carries num_experts, top_k,
             expert_width.

hf and torch use the same architecture as the project's benchmark config (GPT-NeoX: rotary on 25% of each head,
parallel residual, exact GeLU, untied embeddings) and random tokens. Prints one JSON line:
{"step_time": median seconds per optimizer step after warm-up, "peak_gpu_mb" on a GPU}."""

import argparse
import contextlib
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class MinimalBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, rotary_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rotary_dim = heads, hidden // heads, rotary_dim
        self.ln_attn = nn.LayerNorm(hidden)
        self.ln_mlp = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        half1, half2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((-half2, half1), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(self.ln_attn(x)).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        mlp = self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))
        return x + self.proj(attn) + mlp


class MinimalGPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        rotary_dim = (hidden // heads) // 4
        self.blocks = nn.ModuleList(MinimalBlock(hidden, heads, rotary_dim) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        freqs = torch.outer(torch.arange(seq).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        s = tokens.shape[1]
        for block in self.blocks:
            x = block(x, self.cos[:s], self.sin[:s])
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def build(kind: str, shape: dict, device: torch.device):
    if kind == "mixtral":
        return build_mixtral(shape, device)
    if kind == "hf":
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        config = GPTNeoXConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                               num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_attention_heads"],
                               intermediate_size=4 * shape["hidden_size"], rotary_pct=0.25,
                               max_position_embeddings=shape["seq_length"], use_parallel_residual=True,
                               hidden_act="gelu", tie_word_embeddings=False, attention_dropout=0.0,
                               hidden_dropout=0.0, attn_implementation="sdpa")
        model = GPTNeoXForCausalLM(config).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

        def loss_of(tokens, labels):
            return model(input_ids=tokens, labels=tokens).loss
        return model, optimizer, loss_of
    model = MinimalGPT(shape["vocab_size"], shape["hidden_size"], shape["num_layers"], shape["num_attention_heads"],
                       shape["seq_length"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    return model, optimizer, model


def build_mixtral(shape: dict, device: torch.device):
    """transformers' Mixtral of the MoE benchmark's shape (module docstring)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                           num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_attention_heads"],
                           num_key_value_heads=shape["num_attention_heads"], intermediate_size=shape["expert_width"],
                           num_local_experts=shape["num_experts"], num_experts_per_tok=shape["top_k"],
                           max_position_embeddings=shape["seq_length"], tie_word_embeddings=False,
                           output_router_logits=True, router_aux_loss_coef=0.01, attention_dropout=0.0,
                           attn_implementation="sdpa")
    model = MixtralForCausalLM(config).to(device)
    # fused: torch's fastest AdamW on CPU and GPU, as the project's own Adam (single-tensor, the default on CPU, took
    # 0.55 s of a 8.9 s one-thread step against fused's 0.15 s on issue 34's machine)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

    def loss_of(tokens, labels):
        return model(input_ids=tokens, labels=tokens).loss
    return model, optimizer, loss_of


def experts_implementation(model) -> str:
    """Which experts implementation transformers chose for a MoE model (printed with the result)."""
    return str(getattr(model.config, "_experts_implementation", None))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["hf", "torch", "mixtral"])
    parser.add_argument("--shape", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    shape = json.loads(args.shape)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model, optimizer, loss_of = build(args.kind, shape, device)
    model.train()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" \
        else contextlib.nullcontext()
    times = []
    for step in range(args.warmup + args.steps):
        text = torch.randint(1, shape["vocab_size"], (args.batch, shape["seq_length"] + 1), device=device)
        start = time.perf_counter()
        with autocast:
            loss = loss_of(text[:, :-1], text[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        assert math.isfinite(loss.item())
    result = {"step_time": statistics.median(times)}
    if args.kind == "mixtral":
        result["experts_implementation"] = experts_implementation(model)
    if device.type == "cuda":
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(result))


if __name__ == "__main__":
    main()
