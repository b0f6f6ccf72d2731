"""Random layerwise token dropping (random-LTD, megatron.model.random_ltd_settings) on this model's transformer
layers, through DeepSpeed's Data Efficiency library.

DeepSpeed's engine builds the RandomLTDScheduler from the config's data_efficiency section (its
`random_ltd_scheduler`), moves it on each step and saves / loads its state in every checkpoint (the
`random_ltd` entry of the model-states file). Each listed layer gets a TokenDroppingLayer: DeepSpeed's
RandomLayerTokenDrop (its `init_config` reads the section and the scheduler), set as the layer's `token_drop`
child rather than put in the layer's place, so the model's modules and parameter names stay GPT-NeoX's (the
checkpoint layout does not change, and the pipeline module, which calls its layers directly, still calls the same
ones). The wrapper holds the layer's computation as a plain callable, not as a module, so it owns no parameters.

Which gather / scatter runs: DeepSpeed's token_sort_, token_gather and token_scatter_ are CUDA kernels
(deepspeed.ops.op_builder.RandomLTDBuilder is a CUDAOpBuilder that compiles csrc/random_ltd/*.cu with nvcc; on a
CPU accelerator it cannot load, and its GatherTokens / ScatterTokens and gpt_sample_tokens call it unconditionally).
On a CUDA device where the op loads, those run; anywhere else the same three operations in plain PyTorch: the draw
is DeepSpeed's (torch.multinomial over uniform weights, the same RNG draws), sorted so that the kept tokens keep
their order, then torch.gather along the sequence and an out-of-place scatter whose autograd is the pair's
(the gradient of a dropped token passes through unchanged, a kept token's goes through the layer).

The kept tokens keep their places: a rotary layer rotates each by its position in the whole sequence (the draw's
indices), so two kept tokens see each other at their true distance, as in the full sequence with the dropped tokens
masked out. The attention mask is cut to the kept tokens row- and column-wise, per sample (DeepSpeed's decoder path takes the
mask's top-left corner, which is the same thing for a plain causal mask only); a causal-only mask (None, or the
1 x 1 placeholder of megatron.model.batch) stays as it is, since the kept tokens are in order.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from deepspeed.ops.op_builder import RandomLTDBuilder
from deepspeed.ops.random_ltd.dropping_utils import GatherTokens, ScatterTokens, gpt_sample_tokens
from deepspeed.runtime.data_pipeline.constants import RANDOM_LTD_CONSUMED_LAYER_TOKENS, RANDOM_LTD_SAMPLE_INDEX
from deepspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from torch import nn

from megatron.errors import ConfigError
from megatron.model.batch import is_causal_only
from megatron.model.random_ltd_settings import WHERE
from megatron.model.transformer import ParallelTransformerLayer


class _LayerBody:
    """A transformer layer's computation on [batch, seq, hidden] with the mask as a keyword (the call
    RandomLayerTokenDrop makes); not a module, so the wrapper does not own the layer."""

    def __init__(self, layer: ParallelTransformerLayer) -> None:
        self.layer_forward = layer._forward

    def __call__(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.layer_forward(hidden, attention_mask, None, positions)


def deepspeed_kernels_load(device: torch.device) -> bool:
    """Whether DeepSpeed's random-LTD CUDA op loads for ``device`` (never on a CPU)."""
    if device.type != "cuda":
        return False
    try:
        RandomLTDBuilder().load()
        return True
    except Exception:  # the op builder's failures are many (no nvcc, a mismatched CUDA, no ninja)
        return False


def sample_tokens(reserved: int, seq_length: int, batch: int, layers: int, device: torch.device) -> torch.Tensor:
    """DeepSpeed's gpt_sample_tokens in plain torch: [layers, batch, reserved] sorted token indices (int64)."""
    weights = torch.ones((layers * batch, seq_length), device=device)
    drawn = torch.multinomial(weights, reserved).reshape(layers, batch, reserved)
    return drawn.sort(dim=-1).values


def gather_tokens(hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[batch, seq, hidden] -> [batch, kept, hidden] at ``indices`` [batch, kept]."""
    return torch.gather(hidden, 1, indices.long().unsqueeze(-1).expand(-1, -1, hidden.size(-1)))


def scatter_tokens(hidden: torch.Tensor, kept: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``hidden`` with the rows at ``indices`` replaced by ``kept`` (out of place)."""
    return hidden.scatter(1, indices.long().unsqueeze(-1).expand(-1, -1, hidden.size(-1)), kept.to(hidden.dtype))


def kept_mask(mask: Optional[torch.Tensor], indices: torch.Tensor) -> Optional[torch.Tensor]:
    """The [.., seq, seq] attention mask between the kept tokens only: [batch, heads, kept, kept]."""
    if is_causal_only(mask):
        return mask
    batch, kept = indices.shape
    full = mask.expand(batch, *mask.shape[1:])
    index = indices.long()
    rows = torch.gather(full, 2, index[:, None, :, None].expand(-1, full.size(1), -1, full.size(3)))
    return torch.gather(rows, 3, index[:, None, None, :].expand(-1, full.size(1), kept, -1))


class TokenDroppingLayer(RandomLayerTokenDrop):
    """DeepSpeed's RandomLayerTokenDrop around one transformer layer, its token ops chosen by device (see the
    module docstring). ``kept_tokens``: how many tokens per sample the last forward ran the layer on."""

    def __init__(self, layer: ParallelTransformerLayer) -> None:
        super().__init__(_LayerBody(layer))
        self.kept_tokens: Optional[int] = None
        self.use_kernels: Optional[bool] = None

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        self.reserved_length = self.random_ltd_scheduler.get_current_seq()
        self.get_hidden_tensor_shape(hidden_states)
        if not (self.training and self.reserved_length < self.curr_seq):
            self.kept_tokens = self.curr_seq
            return self.random_ltd_layer(hidden_states, **kwargs)
        if self.use_kernels is None:
            self.use_kernels = deepspeed_kernels_load(hidden_states.device)
        state = self.random_ltd_scheduler.state
        if self.random_ltd_layer_id == 0:  # one draw per step, for every dropping layer (as DeepSpeed's)
            state[RANDOM_LTD_SAMPLE_INDEX] = self._sample(hidden_states.device)
        indices = state[RANDOM_LTD_SAMPLE_INDEX][self.random_ltd_layer_id]
        kwargs[self.mask_name] = kept_mask(kwargs.get(self.mask_name), indices)
        kwargs["positions"] = indices  # rotary layers turn each kept token by its place in the whole sequence
        if self.use_kernels:
            hidden_states, part = GatherTokens.apply(hidden_states, indices, self.batch_first)
            out = self.random_ltd_layer(part, **kwargs)
            result = ScatterTokens.apply(hidden_states, out, indices, self.batch_first)
        else:
            out = self.random_ltd_layer(gather_tokens(hidden_states, indices), **kwargs)
            result = scatter_tokens(hidden_states, out, indices)
        self.kept_tokens = out.size(1)
        return result

    def _sample(self, device: torch.device) -> torch.Tensor:
        if self.use_kernels:
            return gpt_sample_tokens(self.reserved_length, self.curr_seq, self.curr_micro_batch,
                                     self.random_ltd_num_layer, device)[0]
        return sample_tokens(self.reserved_length, self.curr_seq, self.curr_micro_batch, self.random_ltd_num_layer,
                             device)


def apply_random_ltd(model: nn.Module, config: dict, scheduler) -> List[TokenDroppingLayer]:
    """Give each transformer layer of ``config['random_ltd_layer_id']`` (DeepSpeed's parsed random_ltd section,
    engine.random_ltd_config()) its TokenDroppingLayer on DeepSpeed's ``scheduler``; returns them in layer order."""
    layers = {m.layer_number: m for m in model.modules() if isinstance(m, ParallelTransformerLayer)}
    wrappers = []
    for count, layer_id in enumerate(sorted(config["random_ltd_layer_id"])):
        layer = layers.get(layer_id)
        if layer is None:
            raise ConfigError([f"{WHERE}.random_ltd_layer_id: layer {layer_id} is not a transformer layer of this "
                               f"rank's model (its layers: {sorted(layers)})"])
        wrapper = TokenDroppingLayer(layer)
        wrapper.init_config(config, scheduler, count)
        layer.token_drop = wrapper
        wrappers.append(wrapper)
    return wrappers


def token_dropping_layers(model: nn.Module) -> List[TokenDroppingLayer]:
    return [m for m in model.modules() if isinstance(m, TokenDroppingLayer)]


def random_ltd_metrics(model: nn.Module, scheduler) -> dict:
    """What the logs say of a step: the tokens per sample the dropping layers ran on, and DeepSpeed's count of
    the layer tokens consumed so far (per layer, summed over the layers and the global batches)."""
    kept = [layer.kept_tokens for layer in token_dropping_layers(model) if layer.kept_tokens is not None]
    return {"random_ltd_kept_tokens": min(kept) if kept else None,
            "random_ltd_layer_tokens": int(scheduler.state[RANDOM_LTD_CONSUMED_LAYER_TOKENS])}
