"""Batched generation on tiny random models (attention, Mamba, RWKV, hybrid) in one process: KV cache == recompute token for token,
greedy is deterministic, top_k=1 is greedy, a batch of left-padded prompts == the prompts one at a time,
EOD stops a row, return_logits are the model's logits, and the sampling filters keep the right tokens."""
import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from megatron.inference.text_generation import (
    SamplingParams,
    SequentialRunner,
    filter_logits,
    generate_tokens,
    left_pad,
    padded_attention_mask,
    padded_position_ids,
    sample_next,
    split_prompts,
)
from tests.model.helpers import tiny_config

EOD = 0
PROMPTS = [[5, 17, 33, 2, 90, 14, 7], [44, 3], [101, 9, 9, 60]]


def _runner(**overrides) -> SequentialRunner:
    args = tiny_config(seq_length=32, init_method_std=0.3, **overrides)
    torch.manual_seed(0)
    return SequentialRunner(build_model(args, SingleProcessState()).eval(), SingleProcessState())


RUNNERS = {"rotary": dict(pos_emb="rotary"), "learned": dict(pos_emb="learned"),
           "mamba": dict(attention_config=[[["mamba"], 2]]), "rwkv": dict(attention_config=[[["rwkv"], 2]]),
           "hybrid": dict(num_layers=3, pos_emb="rotary", attention_config=["mamba", "global", "mamba"])}
"""Attention models, and recurrent ones (whose decoding carries a state, and which see left padding only
through the KV cache's padding: batched == one at a time checks that)."""


@pytest.fixture(scope="module", params=list(RUNNERS))
def runner(request):
    return _runner(**RUNNERS[request.param])


def _generate(runner, prompts=PROMPTS, seed=None, **kwargs):
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    options = dict(eod=EOD, maximum_tokens=10, max_seq_length=32, vocab_size=120, stop_at_eod=False)
    options.update(kwargs)
    return generate_tokens(runner, prompts, generator=generator, **options)


def _tokens(results):
    return [r.tokens for r in results]


def test_kv_cache_equals_recompute_greedy_and_sampled(runner):
    assert _tokens(_generate(runner, recompute=False)) == _tokens(_generate(runner, recompute=True))
    sampled = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
    cached = _generate(runner, params=sampled, seed=3, recompute=False)
    recomputed = _generate(runner, params=sampled, seed=3, recompute=True)
    assert _tokens(cached) == _tokens(recomputed)
    assert all(len(r.tokens) == 10 for r in cached)


def test_runner_knows_whether_the_model_has_recurrent_layers(runner):
    kinds = {type(m).__name__ for m in runner.model.modules()}
    assert runner.recurrent == bool(kinds & {"ParallelMambaResidualLayer", "RWKVResidualLayer"})


def test_greedy_is_deterministic_and_varied(runner):
    first = _tokens(_generate(runner))
    assert first == _tokens(_generate(runner))
    assert len({t for row in first for t in row}) > 2  # not a degenerate constant output


def test_top_k_1_equals_greedy(runner):
    greedy = _tokens(_generate(runner))
    assert _tokens(_generate(runner, params=SamplingParams(temperature=0.7, top_k=1), seed=5)) == greedy


def test_batched_equals_one_at_a_time(runner):
    batched = _generate(runner, return_logits=True)
    for prompt, together in zip(PROMPTS, batched):
        alone = _generate(runner, prompts=[prompt], return_logits=True)[0]
        assert alone.tokens == together.tokens
        torch.testing.assert_close(together.logits, alone.logits, rtol=1e-4, atol=1e-4)


def test_return_logits_are_the_models_logits(runner):
    result = _generate(runner, prompts=[PROMPTS[0]], return_logits=True, maximum_tokens=5)[0]
    full = torch.tensor([result.prompt + result.tokens])
    positions = torch.arange(full.size(1)).unsqueeze(0)
    mask = torch.ones(full.size(1), full.size(1), dtype=torch.bool).triu(1).view(1, 1, full.size(1), -1)
    want = runner(full, positions, mask)[0, len(result.prompt) - 1:-1]
    assert result.logits.shape == (5, 128)
    torch.testing.assert_close(result.logits, want, rtol=1e-4, atol=1e-4)
    assert result.tokens == want[:, :120].argmax(-1).tolist()  # greedy over the tokenizer's ids


def test_sampling_is_seeded_and_differs_between_rows(runner):
    params = SamplingParams(temperature=1.0)
    a = _tokens(_generate(runner, prompts=[[EOD]] * 4, params=params, seed=11))
    assert a == _tokens(_generate(runner, prompts=[[EOD]] * 4, params=params, seed=11))
    assert a != _tokens(_generate(runner, prompts=[[EOD]] * 4, params=params, seed=12))
    assert len({tuple(row) for row in a}) > 1
    assert all(t < 120 for row in a for t in row)  # padded vocabulary ids are never drawn


class _Scripted:
    """A fake model that emits a fixed next token per step (one-hot logits) for every row."""

    supports_cache = True

    def __init__(self, script):
        self.script, self.calls = script, 0

    def __call__(self, tokens, position_ids, attention_mask, kv_cache=None, last_only=False):
        logits = torch.zeros(tokens.size(0), tokens.size(1), 16)
        for row, token in enumerate(self.script[self.calls]):
            logits[row, -1, token] = 10.0
        self.calls += 1
        if kv_cache is not None:
            kv_cache.advance(tokens.size(1))
        return logits


def test_stops_at_eod_per_row():
    script = [[4, 5], [EOD, 6], [7, 8], [9, EOD], [1, 1]]
    fake = _Scripted(script)
    results = generate_tokens(fake, [[3], [3, 3]], eod=EOD, maximum_tokens=10, max_seq_length=32,
                              return_logits=True)
    assert fake.calls == 4  # all rows finished
    assert [r.tokens for r in results] == [[4], [5, 6, 8]]
    assert [r.finished for r in results] == [True, True]
    assert results[0].logits.shape == (2, 16) and results[1].logits.shape == (4, 16)
    unfinished = generate_tokens(_Scripted(script), [[3], [3]], eod=EOD, maximum_tokens=1, max_seq_length=32)
    assert [r.finished for r in unfinished] == [False, False] and [r.tokens for r in unfinished] == [[4], [5]]


def test_prompt_and_budget_fit_the_sequence_length():
    fake = _Scripted([[4]] * 40)
    result = generate_tokens(fake, [list(range(1, 40))], eod=EOD, maximum_tokens=10, max_seq_length=16)[0]
    assert result.prompt == list(range(25, 40)) and result.tokens == [4]
    result = generate_tokens(_Scripted([[4]] * 40), [[1, 2]], eod=EOD, maximum_tokens=50, max_seq_length=8)[0]
    assert len(result.tokens) == 6


def test_padding_masks_and_positions():
    tokens, real = left_pad([[7, 8, 9], [5]], pad_id=0)
    assert tokens.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert padded_position_ids(real).tolist() == [[0, 1, 2], [0, 0, 0]]
    mask = padded_attention_mask(real, 0, 3)
    assert mask.shape == (2, 1, 3, 3)
    assert not mask[0].any()
    assert mask[1, 0].tolist() == [[False, True, True], [True, False, True], [True, True, False]]
    step = padded_attention_mask(torch.cat([real, torch.ones(2, 1, dtype=torch.bool)], 1), 3, 4)
    assert step[1, 0].tolist() == [[True, True, False, False]]


def test_filters():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[True, False, False, True]]
    probs = torch.softmax(logits, -1)[0]  # 0.087, 0.644, 0.237, 0.032
    assert probs[1] < 0.7 < probs[1] + probs[2]
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[True, False, False, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.5)).tolist() == [[True, False, True, True]]
    assert sample_next(logits, SamplingParams()).tolist() == [1]
    draws = sample_next(logits.expand(2000, -1), SamplingParams(temperature=1.0, top_k=2),
                        torch.Generator().manual_seed(0))
    share = (draws == 1).float().mean().item()
    assert set(draws.tolist()) == {1, 2} and abs(share - probs[1] / (probs[1] + probs[2])) < 0.04


def test_bad_sampling_options_are_named():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


def test_sequence_parallel_models_are_refused_and_the_length_limit_is_the_smaller_one():
    from megatron.inference.text_generation import GenerationError, build_runner, max_sequence_length

    class TwoRanks(SingleProcessState):
        def get_model_parallel_world_size(self) -> int:
            return 2

    config = tiny_config(sequence_parallel=True, model_parallel_size=2, seq_length=64, max_position_embeddings=64)
    with pytest.raises(GenerationError, match="sequence_parallel=False"):
        build_runner(object(), TwoRanks(), config)
    assert max_sequence_length(config) == 64
    assert max_sequence_length(tiny_config(seq_length=64, max_position_embeddings=128)) == 64


def test_split_prompts():
    assert split_prompts("a b\n\nc\n", "") == ["a b", "c"]
    assert split_prompts("x<END>y z<END>", "<END>") == ["x", "y z"]


def _parallel_generation(rank: int, world_size: int, layout: dict):
    """Greedy generation (with logits) of a TP=2 or PP=2 model vs the same weights on one rank."""
    import deepspeed

    from megatron.model.gpt2_model import GPT2ModelPipe
    from megatron.mpu import ParallelState
    from megatron.inference.text_generation import PipelineRunner, build_runner

    overrides = dict(pos_emb="rotary", rotary_pct=0.5)
    ref = _runner(**overrides)
    want = generate_tokens(ref, PROMPTS, eod=EOD, maximum_tokens=6, max_seq_length=32, return_logits=True,
                           stop_at_eod=False)
    args = tiny_config(seq_length=32, init_method_std=0.3, **layout, **overrides)
    state = ParallelState(pipe_parallel_size=args.pipe_parallel_size, model_parallel_size=args.model_parallel_size)
    torch.manual_seed(0)
    model = build_model(args, state).eval()
    engine = model
    if isinstance(model, GPT2ModelPipe):
        config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6}
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    runner = build_runner(engine, state, args)
    assert isinstance(runner, PipelineRunner) == (args.pipe_parallel_size > 1)
    got = generate_tokens(runner, PROMPTS, eod=EOD, maximum_tokens=6, max_seq_length=32, return_logits=True,
                          stop_at_eod=False, recompute=False)
    state.destroy()
    return [(w.tokens, g.tokens, w.logits, g.logits) for w, g in zip(want, got)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(model_parallel_size=2), dict(pipe_parallel_size=2)])
def test_tensor_and_pipeline_parallel_generation_match_one_rank(layout):
    from tests.distributed_helpers import run_distributed

    for rank_result in run_distributed(_parallel_generation, world_size=2, args=(layout,)):
        for want_tokens, got_tokens, want_logits, got_logits in rank_result:
            assert got_tokens == want_tokens
            torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
