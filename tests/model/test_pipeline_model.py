"""The DeepSpeed PipelineModule (engine.train_batch) reproduces the sequential model's losses over
several optimizer steps, and starts from exactly the same weights (initialisation does not depend on
the pipe / model parallel layout)."""
import pytest
import torch

from megatron.model.gpt2_model import GPT2ModelPipe, build_model
from megatron.mpu import ParallelState, SingleProcessState
from tests.distributed_helpers import run_distributed
from megatron.model.batch import masks_and_position_ids
from tests.model.helpers import random_batch, tiny_config
from tests.model.tp_helpers import expected_local, gather_vocab

STEPS, MICRO, GAS = 3, 2, 2


def _micro_batches(packed: bool = False):
    """Random micro batches; ``packed``: with end-of-document tokens (0) in each row, as packed documents
    (inter_document_attention_masking: document numbers in the mask slot, positions restarting)."""
    batches = [random_batch(batch=MICRO, seed=100 + i) for i in range(STEPS * GAS)]
    if packed:
        for i, ((tokens, _, _), _) in enumerate(batches):
            tokens[0, 3 + i % 4], tokens[1, 9 - i % 3] = 0, 0
            mask, _, positions = masks_and_position_ids(tokens, 0, False, documents=True)
            batches[i] = ((tokens, positions, mask), batches[i][1])
    return batches


def _reference(args, packed: bool = False):
    model = build_model(args, SingleProcessState())
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches, losses = _micro_batches(packed), []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for inputs, labels in batches[step * GAS:(step + 1) * GAS]:
            loss = model.loss_fn(model(inputs), labels)
            (loss / GAS).backward()
            total += loss.item() / GAS
        opt.step()
        losses.append(total)
    for name, param in model.named_parameters():
        param.data.copy_(initial[name])
    return model, losses


def _sequential_name(pipe_model, name: str) -> str:
    """Map a PipelineModule parameter name ('<slot>.<rest>', or the tied embedding's) to the sequential
    model's: both use GPT-NeoX's slot indices."""
    if name.startswith("tied_modules.embed."):
        return "sequential.0." + name[len("tied_modules.embed."):]
    return f"sequential.{name}"


def _pipeline_losses(rank: int, world_size: int, pipe: int, model_parallel: int, overrides: dict):
    import deepspeed

    layout = dict(pipe_parallel_size=pipe, model_parallel_size=model_parallel)
    overrides = dict(overrides)
    packed = overrides.pop("packed_documents", False)
    args = tiny_config(**layout, **overrides)
    state = ParallelState(**layout)
    model = build_model(args, state)
    assert isinstance(model, GPT2ModelPipe)
    ref, ref_losses = _reference(tiny_config(**dict(layout, pipe_parallel_size=0), **overrides), packed)

    class Renamed(torch.nn.Module):  # view the pipeline's parameters under sequential names
        def __init__(self):
            super().__init__()
            self.params = {_sequential_name(model, n): p for n, p in model.named_parameters()}

        def named_parameters(self, *a, **k):
            return iter(self.params.items())

        def named_modules(self, *a, **k):
            for name, module in model.named_modules():
                if name.split(".")[0].isdigit() or name.startswith("tied_modules.embed."):
                    yield _sequential_name(model, name + ".x")[:-2], module

    for name, (want, got) in expected_local(ref, Renamed(), state.get_model_parallel_rank(),
                                            model_parallel, grads=False).items():
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"init of {name}")

    if pipe == 1:  # one stage holds every layer: the same model as a sequential module
        inputs, _ = random_batch()
        sequential = model.to_sequential()
        assert {id(p) for p in sequential.parameters()} <= {id(p) for p in model.parameters()}
        with torch.no_grad():
            logits = gather_vocab(sequential(inputs), state.get_model_parallel_group())
            torch.testing.assert_close(logits, ref(inputs), rtol=1e-5, atol=1e-5)

    else:
        with pytest.raises(ValueError, match="pipe_parallel_size == 1"):
            model.to_sequential()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": GAS, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    layers = [f for f in model.forward_funcs if type(f).__name__ in model.checkpointable_layers]
    calls = [0] * len(layers)  # forward calls of this stage's layers (a recomputed layer is called again)
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    data = iter(_micro_batches(packed))
    losses = [engine.train_batch(data).item() for _ in range(STEPS)]
    parts = list(model.parts)
    state.destroy()
    return losses, ref_losses, parts, [count // (STEPS * GAS) for count in calls]


@pytest.mark.slow
@pytest.mark.parametrize("pipe,model_parallel,overrides", [
    (2, 1, dict(pos_emb="rotary", activation="swiglu")),
    (2, 1, dict(num_layers=4, no_weight_tying=True, pipe_partition_method="uniform", checkpoint_activations=True,
                recompute_method="block", recompute_num_layers=2)),
    (1, 2, dict(pos_emb="rotary", num_kv_heads=2, sequence_parallel=True)),
    (2, 1, dict(attention_config=["mamba", "rwkv"], checkpoint_activations=True)),
    (2, 1, dict(num_layers=4, attention_config=["mamba", "global", "rwkv", "mamba"])),
    (2, 1, dict(pos_emb="rotary", checkpoint_activations=True, packed_documents=True)),  # starts between stages
    (1, 2, dict(pos_emb="rotary", num_kv_heads=2, sequence_parallel=True, recompute_granularity="selective",
                packed_documents=True)),
])
def test_pipeline_matches_sequential_over_steps(pipe, model_parallel, overrides):
    results = run_distributed(_pipeline_losses, world_size=2, args=(pipe, model_parallel, overrides))
    losses, ref, parts, _ = results[-1]  # the last stage computes the loss
    assert len(losses) == STEPS and ref[0] != ref[-1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    if pipe == 2:
        # GPT-NeoX's 7 slots (embedding, pass, 2 layers, pass, norm, head): type:transformer|mlp balances the
        # 2 transformer layers (slots 2 and 3); uniform balances the 7 slots.
        want = [0, 4, 7] if overrides.get("pipe_partition_method") == "uniform" else [0, 3, 7]
        if overrides.get("num_layers") == 4:  # 9 slots; the default method balances mamba / rwkv layers too
            want = [0, 5, 9] if overrides.get("pipe_partition_method") == "uniform" else [0, 4, 9]
        assert parts == want
    calls = [result[3] for result in results]  # per stage: forward calls of each layer per micro batch
    if overrides.get("recompute_method") == "block":  # the first 2 layers of each stage (3 + 1 layers) recompute
        assert calls == [[2, 2, 1], [2]], calls
    elif overrides.get("checkpoint_activations"):
        assert all(count == 2 for stage in calls for count in stage), calls
    else:
        assert all(count == 1 for stage in calls for count in stage), calls
