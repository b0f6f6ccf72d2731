"""Packed documents (inter_document_attention_masking, megatron.model.packed_attention): a packed batch gives each
document's per-token losses and the gradients of the same documents run one at a time, and no tensor of the
sequence's s x s shape is ever allocated (which the dense reset_attention_mask path does, so the check can fail)."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.model.batch import BatchOptions, get_batch, is_document_starts, masks_and_position_ids, truncate_batch
from megatron.model.gpt2_model import build_model
from megatron.model.packed_attention import document_lengths, restarted_positions
from megatron.mpu import SingleProcessState
from tests.model.helpers import tiny_config

EOD, SEQ = 0, 24
ROWS = ([6, 1, 9, 8], [11, 13])
"""The documents' lengths in each packed row (each ends with EOD but a row's last, cut off by the row's end)."""

PATHS = {
    "learned": (dict(pos_emb="learned"), False),
    "rotary_gqa_qk_norm": (dict(pos_emb="rotary", num_kv_heads=2, use_qk_layernorm=True), False),
    "alibi_window": (dict(pos_emb="alibi", sliding_window_width=4), False),
    "rpe_fused_softmax": (dict(pos_emb="rpe"), True),
}
"""name: (config overrides, whether the layers take the fused-softmax path, here with the kernels' PyTorch
references); between them SDPA's causal kernel, its masked path with an additive bias, a window, grouped-query
heads, restarted rotary / learned positions and the explicit-scores path per document."""


class SquareAllocations(TorchDispatchMode):
    """Records every op output whose last two dimensions are both ``size`` (an s x s mask or score matrix)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.seen = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.size, self.size):
                self.seen.append((str(func), tuple(t.shape)))
        return out


def packed_text(seed: int = 0) -> torch.Tensor:
    """[rows, SEQ + 1] random text whose documents (ROWS, the last one a token longer: the labels' shift) end with
    EOD; no other token is EOD."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in ROWS:
        assert sum(lengths) == SEQ
        row = torch.randint(1, 128, (SEQ + 1,), generator=gen)
        for end in torch.tensor(lengths).cumsum(0)[:-1]:
            row[end - 1] = EOD
        rows.append(row)
    return torch.stack(rows)


def per_token_losses(model, tokens, positions, mask, labels) -> torch.Tensor:
    logits = model((tokens, positions, mask)).float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none").view(
        labels.shape)


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("path", PATHS)
def test_a_packed_batch_gives_the_losses_and_gradients_of_its_documents_run_one_at_a_time(path):
    torch.manual_seed(0)
    overrides, fused = PATHS[path]
    config = tiny_config(seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    model = build_model(config, SingleProcessState()).train()
    for layer in model.layers:
        layer.attention.fused_softmax = fused
    text = packed_text()
    tokens, labels = text[:, :-1], text[:, 1:]
    mask, _, positions = masks_and_position_ids(tokens, EOD, False, documents=True)
    assert is_document_starts(mask) and mask.dtype == torch.bool and tuple(mask.shape) == (len(ROWS), SEQ)
    with SquareAllocations(SEQ) as squares:
        packed = per_token_losses(model, tokens, positions, mask, labels)
        packed.sum().backward()
    assert squares.seen == [], squares.seen
    packed_grads = gradients(model)

    model.zero_grad()
    alone, total = [], 0.0
    for row, lengths in enumerate(ROWS):
        start = 0
        for n in lengths:
            doc_tokens, doc_labels = tokens[row:row + 1, start:start + n], labels[row:row + 1, start:start + n]
            doc_mask, _, doc_positions = masks_and_position_ids(doc_tokens, None, False)
            losses = per_token_losses(model, doc_tokens, doc_positions, doc_mask, doc_labels)
            total = total + losses.sum()
            alone.append(losses)
            start += n
    total.backward()
    alone = torch.cat(alone, dim=1).view(len(ROWS), SEQ)
    assert torch.allclose(packed, alone, atol=1e-5, rtol=0), \
        f"{path}: max |packed - alone| {(packed - alone).abs().max().item():.3g}\npacked {packed}\nalone {alone}"
    for name, grad in gradients(model).items():
        diff = (packed_grads[name] - grad).abs().max().item()
        assert diff <= 1e-5, f"{path}: {name} gradient differs by {diff:.3g} (|grad| max {grad.abs().max():.3g})"


def test_the_square_check_sees_the_dense_reset_attention_mask():
    """The allocation check can fail: GPT-NeoX's dense per-document mask is [b, 1, s, s]."""
    model = build_model(tiny_config(seq_length=SEQ), SingleProcessState())
    tokens = packed_text()[:, :-1]
    with SquareAllocations(SEQ) as squares:
        mask, _, positions = masks_and_position_ids(tokens, EOD, False, reset_position_ids=True,
                                                    reset_attention_mask=True)
        model((tokens, positions, mask))
    assert squares.seen


def test_document_lengths_positions_and_the_curriculum_cut():
    tokens = packed_text()[:, :-1]
    mask, _, positions = masks_and_position_ids(tokens, EOD, False, documents=True)
    lengths = document_lengths(mask)
    assert lengths == [n for row in ROWS for n in row]
    assert torch.equal(restarted_positions(lengths, tokens.device), positions.reshape(-1))
    batch = get_batch(BatchOptions(documents=True), {"text": packed_text()}, SingleProcessState(), eod_token=EOD)
    (cut_tokens, cut_positions, cut_mask), _ = truncate_batch(batch, 10)
    assert torch.equal(cut_mask, mask[:, :10]) and torch.equal(cut_positions, positions[:, :10])


def test_the_config_switch_reaches_the_model_and_gpt_neox_flags_mean_the_same():
    """inter_document_attention_masking from a config: the run's batches carry document numbers, positions restart
    and the model attends per document (no s x s tensor); GPT-NeoX's reset_attention_mask + reset_position_ids take
    the same path, reset_attention_mask alone keeps its dense mask; what the switch does not serve is refused."""
    from megatron.initialize import RunContext
    from megatron.model.config import ModelConfig
    from megatron.training.batches import ModelBatches
    from tests.neox_arguments.helpers import problems_of, tiny

    def batch_of(args):
        ctx = RunContext(parallel_state=SingleProcessState(), rng_tracker=None,
                         tokenizer=type("T", (), {"eod": EOD})(), device=torch.device("cpu"),
                         model_config=ModelConfig.from_neox_args(args, padded_vocab_size=128))
        return ctx, next(ModelBatches(args, ctx, iter([{"text": packed_text()}])))

    shape = dict(seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    ctx, (inputs, labels) = batch_of(tiny(inter_document_attention_masking=True, **shape))
    tokens, positions, mask = inputs
    assert is_document_starts(mask) and positions[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    model = build_model(ctx.model_config, SingleProcessState())
    with SquareAllocations(SEQ) as squares:
        model(inputs)
    assert squares.seen == []
    assert is_document_starts(batch_of(tiny(reset_attention_mask=True, reset_position_ids=True, **shape))[1][0][2])
    dense = batch_of(tiny(reset_attention_mask=True, **shape))[1][0][2]
    assert dense.dtype == torch.bool and tuple(dense.shape) == (2, 1, SEQ, SEQ)
    text = problems_of(inter_document_attention_masking=True, num_gpus=2, context_parallel_size=2,
                       attention_config=[[["global", "rwkv"], 1]], soft_prompt_tuning={"enabled": True})
    for expected in ("attention_config layer types ['rwkv'] with inter_document_attention_masking",
                     "context_parallel_size=2 with inter_document_attention_masking",
                     "soft_prompt_tuning with inter_document_attention_masking"):
        assert expected in text, text


def test_flash_attn_varlen_gets_the_documents_cumulative_lengths_and_restarted_rotary_positions(monkeypatch):
    """Where flash-attn is installed (CUDA, half precision) packed documents go through flash_attn_varlen_func in one
    call: here a stand-in computes what it computes (causal attention within each [cu[i], cu[i + 1]) span) on CPU,
    and the model's outputs equal the per-document SDPA path's."""
    from megatron.model.flash import FlashAttention

    spans = []

    def varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal, window_size,
               alibi_slopes):
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32 and causal
        cu = cu_seqlens_q.tolist()
        spans.append((cu, max_seqlen_q))
        heads = lambda t, a, b: t[a:b].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        return torch.cat([F.scaled_dot_product_attention(heads(q, a, b), heads(k, a, b), heads(v, a, b), is_causal=True,
                                                         enable_gqa=True)[0].transpose(0, 1)
                          for a, b in zip(cu[:-1], cu[1:])])

    torch.manual_seed(0)
    model = build_model(tiny_config(seq_length=SEQ, pos_emb="rotary", num_kv_heads=2, attention_config=[[["flash"], 2]]),
                        SingleProcessState()).eval()
    tokens = packed_text()[:, :-1]
    inputs = masks_and_position_ids(tokens, EOD, False, documents=True)
    inputs = (tokens, inputs[2], inputs[0])
    with torch.no_grad():
        per_document = model(inputs)
        monkeypatch.setattr(FlashAttention, "supports", lambda self, q: True)
        for layer in model.layers:
            layer.attention.flash = FlashAttention(None, layer.attention.head_dim, varlen)
        varlen_out = model(inputs)
    assert spans == [([0, 6, 7, 16, 24, 35, 48], 13)] * 2, spans
    assert torch.allclose(varlen_out, per_document, atol=1e-5, rtol=0), (varlen_out - per_document).abs().max()
