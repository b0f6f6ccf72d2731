"""gMLP and aMLP layers (attention_config types 'gmlp', 'amlp'): GPT-NeoX's GMLPBlock, tensor parallel.

Block (GPT-NeoX's, Liu et al. 2021 "Pay Attention to MLPs"), with F = 4 x hidden_size and s the sequence::

    z = act(input_linear(norm(x)))          # [b, s, 2F] = [res | gate]
    gate = proj(sgu.norm(gate))             # causal spatial projection over positions: W [seq_length x
                                            #   seq_length] masked to its lower triangle (init 0), bias (init 1)
    gate += attn(z)                         # aMLP only: one causal head of width gmlp_attn_dim over z
    out = output_linear(res * gate)

As in GPT-NeoX the block's output replaces x (no residual around the block), its two linears add no bias
(GPT-NeoX creates input_linear.bias / output_linear.bias but drops them: ``skip_bias_add`` returns them and
the block discards them, so here they do not exist; checkpoints still hold them as zeros for GPT-NeoX's
loader, megatron.model.checkpoint_layout), the spatial projection ignores the attention mask (it
mixes absolute positions 0..s-1), and the tiny attention uses it (end-of-document resets included). The
norms are ``norm``; the activation is ``activation`` (GLU activations are refused: the block splits its own
projection). Parameter names are GPT-NeoX's (norm, input_linear, sgu.norm, sgu.proj, sgu.attn.proj_qkv,
sgu.attn.proj_ffn, output_linear); the linears start from init_method / output_layer_init_method where GPT-NeoX's
tiny attention keeps torch's default.

Tensor parallelism (equal to TP=1, which GPT-NeoX's is not: there each rank normalises and attends over its
own slice of F): input_linear is column-parallel with [res | gate] as two chunks, so each rank holds its share
of both; sgu.norm normalises the whole gate (all-gathered over the channel dimension; its backward
reduce-scatters) with full, replicated weights; sgu.proj is replicated and sees each rank's channels;
proj_qkv is row-parallel over the two chunks (q, k, v replicated), proj_ffn column-parallel, output_linear
row-parallel. Replicated weights that each rank applies to its own channels sum their gradients over the
ranks (copy_to_model_parallel_region). Sequence parallelism is refused for these layers, and so are GPT-NeoX
checkpoints with these layers saved at model_parallel_size > 1 (megatron.checkpoint.engine.gpt_neox_gmlp_problem).

Decoding (``KVCache``): each layer keeps the normalised gates (and, for aMLP, the keys and values) of the
positions so far as its recurrent state; a new token's gate is its row of the projection over them. Positions
stop at seq_length (the projection's size). Left-padded batches of prompts of different lengths are refused
(megatron.inference.text_generation hands these layers the padding through the cache, as for Mamba / RWKV).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.activations import get_activation
from megatron.model.checkpoint_layout import GMLP_LAYER, install_hooks
from megatron.model.config import GMLP_FF_MULT, ModelConfig
from megatron.model.kv_cache import KVCache
from megatron.model.norms import build_norm
from megatron.mpu import ColumnParallelLinear, RowParallelLinear, copy_to_model_parallel_region
from megatron.mpu.collectives import _split, gather_from_sequence_parallel_region


class TinyAttention(nn.Module):
    """aMLP's single head of width gmlp_attn_dim over [res | gate], added to the gate."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int, ff: int) -> None:
        super().__init__()
        d = config.gmlp_attn_dim
        self.scale = d ** -0.5
        self.proj_qkv = RowParallelLinear(2 * ff, 3 * d, parallel_state,
                                          initializer.weight(layer_number, "gmlp.attn.proj_qkv"), chunks=2)
        self.proj_ffn = ColumnParallelLinear(d, ff, parallel_state,
                                             initializer.output_weight(layer_number, "gmlp.attn.proj_ffn"))

    def forward(self, z: torch.Tensor, attention_mask: Optional[torch.Tensor], offset: int,
                past: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(this rank's gate increment, all keys, all values) for ``z`` at positions offset.. after ``past``."""
        q, k, v = self.proj_qkv(z).chunk(3, dim=-1)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        q_pos = torch.arange(offset, offset + q.size(1), device=z.device)
        k_pos = torch.arange(k.size(1), device=z.device)
        allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(-1)
        if attention_mask is not None:
            allowed = allowed & ~attention_mask.to(torch.bool)[:, 0]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        return self.proj_ffn(out), k, v


class SpatialGatingUnit(nn.Module):
    """gate <- proj(norm(gate)) [+ tiny attention]; returns res * gate (this rank's channels)."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int, ff: int,
                 use_attention: bool) -> None:
        super().__init__()
        tp = parallel_state.get_model_parallel_world_size()
        self.group = parallel_state.get_model_parallel_group() if tp > 1 else None
        self.norm = build_norm(config, ff, grad_reduce_group=self.group)
        s = config.seq_length
        self.proj = nn.Linear(s, s)
        nn.init.zeros_(self.proj.weight)
        nn.init.ones_(self.proj.bias)
        self.attn = TinyAttention(config, parallel_state, initializer, layer_number, ff) if use_attention else None

    def _normed_gate(self, gate: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.norm(gate)
        full = gather_from_sequence_parallel_region(gate, self.group, seq_dim=gate.dim() - 1)
        return _split_channels(self.norm(full), self.group)

    def forward(self, z: torch.Tensor, attention_mask: Optional[torch.Tensor], offset: int,
                state: Optional[Tuple[torch.Tensor, ...]]) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
        res, gate = z.chunk(2, dim=-1)
        gates = self._normed_gate(gate)
        if state is not None:
            gates = torch.cat([state[0], gates], dim=1)
        end = offset + z.size(1)
        if end > self.proj.weight.size(0):
            raise ValueError(f"a gMLP layer mixes at most seq_length={self.proj.weight.size(0)} positions (its "
                             f"spatial projection's size); position {end - 1} is beyond it")
        weight, bias = self.proj.weight, self.proj.bias
        if self.group is not None:
            weight, bias = copy_to_model_parallel_region(weight, self.group), \
                copy_to_model_parallel_region(bias, self.group)
        weight = weight[offset:end, :end].tril(offset)
        mixed = torch.einsum("ts,bsc->btc", weight, gates) + bias[offset:end].unsqueeze(-1)
        new_state: Tuple[torch.Tensor, ...] = (gates,)
        if self.attn is not None:
            past = (state[1], state[2]) if state is not None else None
            extra, k, v = self.attn(z, attention_mask, offset, past)
            mixed = mixed + extra
            new_state = (gates, k, v)
        return res * mixed, new_state


def _split_channels(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of the last dimension; the gradient flows back into that chunk only (the gather's
    backward sums the ranks' chunks)."""
    return _split(x, x.dim() - 1, group)


class GMLPBlock(nn.Module):
    """GPT-NeoX's gMLP / aMLP layer (module docstring), called with (hidden, mask) like every block."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int, rng_tracker,
                 rpe=None) -> None:
        super().__init__()
        self.layer_number = layer_number
        hidden = config.hidden_size
        ff = GMLP_FF_MULT * hidden
        self.norm = build_norm(config, hidden)
        self.input_linear = ColumnParallelLinear(hidden, 2 * ff, parallel_state,
                                                 initializer.weight(layer_number, "gmlp.input_linear"), bias=False,
                                                 chunks=2)
        self.activation, _ = get_activation(config.activation, config.onnx_safe)
        self.sgu = SpatialGatingUnit(config, parallel_state, initializer, layer_number, ff,
                                     use_attention=config.attention_types[layer_number] == "amlp")
        self.output_linear = RowParallelLinear(ff, hidden, parallel_state,
                                               initializer.output_weight(layer_number, "gmlp.output_linear"),
                                               bias=False)
        install_hooks(self, GMLP_LAYER, config, parallel_state)

    def forward(self, args: Tuple[torch.Tensor, Optional[torch.Tensor]], kv_cache: Optional[KVCache] = None):
        x, mask = args
        if kv_cache is not None and kv_cache.padding is not None:
            raise ValueError("gMLP / aMLP layers mix absolute positions (slot t with slots 0..t), so left-padded "
                             "prompts of different lengths would mix pad slots in: decoding such a batch is not "
                             "supported yet; decode prompts of one length per batch")
        state = kv_cache.recurrent_state(self.layer_number) if kv_cache is not None else None
        offset = kv_cache.length if kv_cache is not None else 0
        z = self.activation(self.input_linear(self.norm(x)))
        gated, state = self.sgu(z, mask, offset, state)
        if kv_cache is not None:
            kv_cache.set_recurrent_state(self.layer_number, state)
        return self.output_linear(gated), mask

