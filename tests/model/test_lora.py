"""LoRA (megatron.model.lora, megatron.mpu.lora): the lora section's rules; the untrained adapters leave the model
exactly as it was; only the adapters train and reach the optimizer; an adapter computes peft's update
W x + b + (alpha / r) B A x; at tensor parallel 2 the split factors give the TP=1 logits, loss and gradients."""

import math

import pytest
import torch

from megatron.model.config import ModelConfig
from megatron.model.gpt2_model import build_model
from megatron.model.lora import is_lora_parameter, lora_targets
from megatron.mpu import SingleProcessState
from megatron.mpu.lora import LoRAAdapter
from megatron.optim.param_groups import get_param_groups
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, tiny_config

ALL_TARGETS = dict(r=4, alpha=8, target_modules=["query_key_value", "dense", "dense_h_to_4h", "linear2"])


def randomize_lora_b(model: torch.nn.Module) -> None:
    """Give every B a seeded value (the full tensor's shard on this rank), so that the adapters change the output."""
    with torch.no_grad():
        for index, module in enumerate(m for m in model.modules() if isinstance(m, LoRAAdapter)):
            full_rows = module.lora_B.size(0) * (module.tp_world if module.column else 1)
            full = torch.randn(full_rows, module.rank, generator=torch.Generator().manual_seed(index))
            if module.column:
                from megatron.mpu import shard_of
                full = shard_of(full, 0, module.tp_rank, module.tp_world, module.chunks)
            module.lora_B.copy_(full)


@pytest.mark.parametrize("lora, problem", [
    (dict(rank=4, lora_alpa=8), "lora.lora_alpa is not a LoRA setting; did you mean lora_alpha"),
    (dict(r=4, dropuot=0.1), "lora.dropuot is not a LoRA setting; did you mean dropout"),
    (dict(r=4, load_in_4bit=True), "lora.load_in_4bit: QLoRA"),
    (dict(r=4, bnb_4bit_quant_type="nf4"), "lora.bnb_4bit_quant_type: QLoRA"),
    (dict(r=4, use_dora=True), "lora.use_dora: DoRA are not implemented"),
    (dict(r=0), "lora.r=0 must be an integer >= 1"),
    (dict(alpha=-1), "lora.alpha=-1 must be a number > 0"),
    (dict(dropout=1.0), "lora.dropout=1.0 must be a number in [0, 1)"),
    (dict(target_modules=["query_key_valu"]), "'query_key_valu' is not a layer of this model; did you mean "
                                              "query_key_value"),
    (dict(layers_to_transform=[2]), "lora.layers_to_transform=[2] must be null (every layer) or a list"),
])
def test_bad_sections_are_refused_naming_the_key(lora, problem):
    problems = tiny_config(lora=lora).problems()
    assert any(problem in p for p in problems), problems


def test_layers_it_cannot_adapt_are_refused():
    moe = tiny_config(moe_num_experts=2, lora=dict(target_modules=["linear1"])).problems()
    assert any("mixture of experts" in p for p in moe), moe
    assert not [p for p in tiny_config(moe_num_experts=2, lora={}).problems() if "lora" in p]
    mamba = tiny_config(attention_config=[[["mamba", "global"], 1]], lora={"r": 2}).problems()
    assert any("mamba layers have no query_key_value" in p for p in mamba), mamba
    assert not tiny_config(attention_config=[[["mamba", "global"], 1]], lora={"layers_to_transform": 1}).problems()
    rm = tiny_config(train_impl="rm", lora={"r": 2}).problems()
    assert any("lora with train_impl 'rm': not implemented" in p for p in rm), rm
    assert not tiny_config(pipe_parallel_size=2, lora={"r": 2}).problems()  # a pipeline of stages adapts each


def test_defaults_and_names():
    config = tiny_config(lora={"lora_alpha": 16, "target_modules": ["dense_4h_to_h", "dense"]})
    assert config.lora_dict == dict(r=8, alpha=16, dropout=0.0, target_modules=["dense", "linear2"],
                                    layers_to_transform=None)
    assert tiny_config(lora={}).lora_dict is None and tiny_config().lora_dict is None


@pytest.mark.parametrize("overrides", [dict(), dict(pos_emb="rotary", num_kv_heads=2, activation="swiglu",
                                                    norm="rmsnorm", use_bias_in_attn_linear=False)])
def test_untrained_adapters_are_the_base_model_and_only_they_train(overrides):
    inputs, labels = random_batch()
    base = build_model(tiny_config(**overrides), SingleProcessState())
    model = build_model(tiny_config(lora=dict(ALL_TARGETS, layers_to_transform=[1]), **overrides),
                        SingleProcessState())
    assert torch.equal(model(inputs), base(inputs))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(is_lora_parameter(n) for n in names), names
    assert len(names) == 8 and all(".1." in n or "sequential.3." in n for n in names), names  # layer 1 only
    trained = {id(p) for group in get_param_groups(model, 0.01) for p in group["params"]}
    assert trained == {id(p) for n, p in model.named_parameters() if is_lora_parameter(n)}
    loss = model.loss_fn(model(inputs), labels)
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not is_lora_parameter(n))
    assert all(p.grad is not None for n, p in model.named_parameters() if n.endswith("lora_B"))


def test_adapter_adds_peft_update():
    """Each adapted layer computes W x + b + (alpha / r) B A x (peft's lora.Linear, dropout 0); A starts as peft's
    kaiming-uniform (bound 1 / sqrt(in))."""
    config = tiny_config(lora=ALL_TARGETS)
    model = build_model(config, SingleProcessState())
    randomize_lora_b(model)
    x = torch.randn(2, 3, config.hidden_size)
    for number, target, linear, _ in lora_targets(model, config):
        a, b = linear.lora.lora_A, linear.lora.lora_B
        assert a.abs().max() <= 1 / math.sqrt(linear.input_size) and b.abs().sum() > 0
        inp = x if target != "linear2" else torch.randn(2, 3, linear.input_size)
        want = inp @ linear.weight.T + (0 if linear.bias is None else linear.bias) + 2.0 * (inp @ a.T) @ b.T
        with torch.no_grad():
            torch.testing.assert_close(linear(inp), want, rtol=1e-5, atol=1e-5, msg=f"layer {number} {target}")


LORA_TP_CONFIGS = [
    dict(lora=dict(ALL_TARGETS, dropout=0.0), no_weight_tying=True),
    dict(lora=dict(ALL_TARGETS, layers_to_transform=[0]), pos_emb="rotary", num_kv_heads=2, activation="swiglu",
         norm="rmsnorm", sequence_parallel=True),
]


def _compare_lora_tp(rank: int, world_size: int) -> None:
    from tests.model.test_tensor_parallel_model import compare_tp2_with_tp1

    compare_tp2_with_tp1(rank, world_size, configs=LORA_TP_CONFIGS, adjust=randomize_lora_b)


@pytest.mark.slow
def test_tp2_split_adapters_match_tp1():
    """A replicated / B split by output rows on column-parallel layers (the GLU's and GQA's blocks too), A split by
    input columns / B replicated on row-parallel ones: TP=2 gives TP=1's logits, loss and adapter gradients."""
    run_distributed(_compare_lora_tp, world_size=2)


ROW_TARGETS = ("dense", "linear2")


def _dropout_masks_at_tp2(rank: int, world_size: int) -> None:
    """One training forward of a TP=2 model with LoRA dropout 0.5 on every target, the adapters' inputs, dropout
    outputs and outputs caught by hooks (see the test)."""
    import torch.distributed as dist

    from megatron.mpu import ParallelState

    config = tiny_config(model_parallel_size=2, lora=dict(ALL_TARGETS, dropout=0.5))
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
    group = state.get_model_parallel_group()
    model = build_model(config, state)
    randomize_lora_b(model)
    seen: dict = {}
    for number, target, linear, _ in lora_targets(model, config):
        key = (number, target)
        linear.lora.dropout.register_forward_hook(
            lambda module, inputs, output, key=key: seen.setdefault(key, {}).update(x=inputs[0], dropped=output))
        linear.lora.register_forward_hook(
            lambda module, inputs, output, key=key: seen.setdefault(key, {}).update(out=output))
    torch.manual_seed(0)  # the default stream, the same on both ranks as in training
    with torch.no_grad():
        model.train()(random_batch()[0])

    def gathered(tensor: torch.Tensor) -> list:
        """Each tensor-parallel rank's ``tensor``, in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return parts

    assert {target for _, target in seen} == {"query_key_value", "dense", "linear1", "linear2"}, sorted(seen)
    for (number, target), caught in sorted(seen.items()):
        x, dropped = caught["x"], caught["dropped"]
        mask = dropped != 0
        gap = (dropped - x * mask * 2.0).abs().max().item()
        assert gap < 1e-6, f"layer {number} {target}: not dropout 0.5 of x ({gap:.3e})"
        masks = [part.bool() for part in gathered(mask.to(torch.uint8))]
        same = torch.equal(masks[0], masks[1])
        if target in ROW_TARGETS:  # each rank's own input partition: independent masks
            assert not same, f"layer {number} {target}: both ranks drew the same mask for their partitions"
            adapter = dict((t, linear) for n, t, linear, _ in lora_targets(model, config) if n == number)[target].lora
            whole = torch.cat(masks, dim=-1)  # the mask over the whole input (TP=1's)
            x_whole, a_whole = torch.cat(gathered(x), dim=-1), torch.cat(gathered(adapter.lora_A.detach()), dim=1)
            want = (x_whole * whole * 2.0) @ a_whole.T @ adapter.lora_B.detach().T * adapter.scale
            got = caught["out"].clone()
            dist.all_reduce(got, group=group)
            gap = (got - want).abs().max().item()
            assert gap <= 1e-6 + 1e-5 * want.abs().max().item(), \
                f"layer {number} {target}: the TP=2 sum differs from TP=1's with the same mask by {gap:.3e}"
        else:  # the replicated input: the same mask on both ranks, as at TP=1
            assert same, f"layer {number} {target}: the ranks dropped different entries of the same input"


@pytest.mark.slow
def test_tp2_dropout_masks_are_independent_per_partition_on_row_parallel_targets():
    """LoRA dropout at tensor parallel 2: a row-parallel target's (dense, linear2) input is split over the ranks, and
    its mask comes from the model-parallel RNG stream, so the ranks' masks differ and together are one mask over the
    whole input: the ranks' summed outputs are the unsplit adapter's on the whole input under that mask. A
    column-parallel target's (query_key_value, linear1) input is the same on both ranks, and so is its mask."""
    run_distributed(_dropout_masks_at_tp2, world_size=2)


def test_zero_with_lora_is_accepted_but_zero_3_with_tensor_parallelism():
    from tests.neox_arguments.helpers import problems_of, tiny

    assert "lora with zero_optimization.stage=3 and model_parallel_size=2: not supported yet: ZeRO-3 keeps the " \
        "adapters in its partitioned files" in problems_of(lora={"r": 2}, zero_optimization={"stage": 3},
                                                           model_parallel_size=2, num_gpus=2)
    for stage in (1, 2, 3):
        assert tiny(lora={"r": 2}, zero_optimization={"stage": stage}).zero_stage == stage
    assert "lora.rnak is not a LoRA setting; did you mean rank" in problems_of(lora={"rnak": 2})


def test_dpo_with_lora_in_a_pipeline_is_refused_unless_the_reference_is_precomputed_or_free():
    from tests.neox_arguments.helpers import problems_of

    dpo = dict(lora={"r": 2}, num_gpus=2, train_impl="dpo", dataset_impl="pairwise")
    refused = "lora with train_impl 'dpo' and pipe_parallel_size=2: not implemented yet. Under LoRA the reference"
    assert refused in problems_of(**dpo, pipe_parallel_size=2)
    assert "lora with" not in problems_of(**dpo, pipe_parallel_size=2, dpo_reference_free=True)  # data still missing
    assert "lora with" not in problems_of(**dpo, pipe_parallel_size=1)
