"""megatron.mpu.host_collectives, the one home for values that cross ranks, and the helpers that use it.

Without a world: every function is the identity; the device decision from a group's backends (torch's
``_device_types``, or the backend's name where a group has none).

Under a CUDA-only world (2 ranks, ``backend="cuda:gloo"``: NCCL's device rule on CPU, tests/mpu/emulated_cuda.py
makes CUDA tensors exist): each host-side helper that crosses ranks (the training loop's stop flag, checkpoint space
check, objective metrics, tokens per character, loss mean and rank 0's finding, the MoE load metrics, the gradient
norm and clipping, the logger's optimizer-state norms and debug sums, checkpoint verification, the async
checkpoint's agreement and digests, the data builders' failure exchange) gives the right value and hands every
collective a CUDA tensor (or stages its pickles on CUDA). Before this home the stop flag died there exactly as on
the GPU: "No backend type associated with device type cpu"."""
import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

from megatron.mpu import host_collectives
from tests.distributed_helpers import run_distributed


def test_without_a_world_every_function_is_the_identity():
    assert host_collectives.communication_device() == torch.device("cpu")
    assert host_collectives.world_size() == 1
    summed = host_collectives.all_reduce([1.0, 2.0], op="max")
    assert summed.dtype == torch.float64 and summed.tolist() == [1.0, 2.0]
    x = torch.ones(2)
    assert host_collectives.all_reduce(x) is x and host_collectives.broadcast(x, src=0) is x
    assert host_collectives.all_gather(x) is x
    assert host_collectives.broadcast_object({"a": 1}, src=0) == {"a": 1}
    assert host_collectives.all_gather_object(3) == [3] and host_collectives.gather_object(3, dst=0) == [3]
    host_collectives.barrier()
    with pytest.raises(ValueError, match="reduce op 'mean'"):
        host_collectives.all_reduce([1.0], op="mean")


@pytest.mark.parametrize("backend, device_types, device", [
    ("nccl", None, "cuda:3"), ("gloo", None, "cpu"), ("cpu:gloo,cuda:nccl", None, "cpu"), ("cuda:gloo", None, "cuda:3"),
    ("mpi", None, "cpu"), ("whatever", ["cuda"], "cuda:3"), ("whatever", ["cuda", "cpu"], "cpu"),
])
def test_the_communication_device_follows_what_the_group_serves(monkeypatch, backend, device_types, device):
    """From the group's ``_device_types`` where it has them, else from the backend's name (older torch, other
    backends); a CUDA group communicates on the current CUDA device."""
    dist = host_collectives.dist
    group = SimpleNamespace(_device_types=[torch.device(t) for t in device_types]) if device_types else object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda g=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert host_collectives.communication_device(group) == torch.device(device)


def test_object_collectives_bypass_deepspeed_comm(monkeypatch):
    """DeepSpeed 0.19's comms logger (prof_all) ends the process with exit(0) at an all_gather_object (no bandwidth
    formula for it: tests/e2e/test_deepspeed_features.py died so): objects go through torch.distributed."""
    dist = host_collectives.dist
    seen = []

    class NoObjectsHere:
        def __getattr__(self, name):
            raise AssertionError(f"{name} went through deepspeed.comm")

    monkeypatch.setattr(host_collectives, "collectives", NoObjectsHere)
    monkeypatch.setattr(host_collectives, "world_size", lambda group=None: 2)
    monkeypatch.setattr(host_collectives, "communication_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    for name in ("broadcast_object_list", "all_gather_object", "gather_object"):
        monkeypatch.setattr(dist, name, lambda *args, _name=name, **kwargs: seen.append(_name))
    host_collectives.broadcast_object(1, src=0)
    host_collectives.all_gather_object(1)
    host_collectives.gather_object(1, dst=0)
    assert seen == ["broadcast_object_list", "all_gather_object", "gather_object"]


# ------------------------------------------------------------------------------------------------------------
# Under a CUDA-only world
# ------------------------------------------------------------------------------------------------------------

def _checks(rank: int, emulation):
    """{name: a function returning the helper's result on this rank}; every rank runs them in this order (each in
    its own emulated_cuda_world, whose record is ``emulation.current``)."""
    from torch import nn

    def any_rank():
        from megatron.training.loop import StopRequested

        stop = StopRequested()
        stop.signal_name = "SIGTERM" if rank == 1 else None
        return stop.any_rank(deadline=0.0 if rank == 0 else None)

    def check_space():
        from megatron.training.loop import _check_space_for_a_checkpoint

        engine = SimpleNamespace(module=nn.Linear(4, 4))
        ctx = SimpleNamespace(parallel_state=SimpleNamespace(get_data_parallel_world_size=lambda: 2))
        return _check_space_for_a_checkpoint(SimpleNamespace(save=tempfile.mkdtemp()), engine, ctx)

    def objective_metrics():
        from megatron.training.step import objective_metrics

        loss_fn = SimpleNamespace(take_metrics=lambda: {"accuracy": float(rank), "margin": 2.0})
        engine = SimpleNamespace(module=SimpleNamespace(loss_fn=loss_fn),
                                 mpu=SimpleNamespace(get_data_parallel_group=lambda: None))
        return objective_metrics(engine)

    def tokens_per_char():
        from megatron.training.step import tokens_per_char

        return tokens_per_char(3 * (rank + 1), 4)

    def loss_mean():
        from megatron.training.step import data_parallel_mean

        return data_parallel_mean(torch.tensor(rank + 1.0), SimpleNamespace(mpu=None))

    def agreed_problem():
        from megatron.training.loop import _agreed_problem

        return _agreed_problem("rank 0's finding" if rank == 0 else None)

    def moe_metrics():
        from megatron.model.moe.stats import MoELayerBase, moe_metrics

        layer = MoELayerBase()
        layer.setup_stats(num_experts=2, layer_number=0, loss_coeff=0.1)
        cuda = torch.device("cuda", 0)  # a forward's counts on the GPU: recording them reads nothing back
        routed, aux = torch.tensor([rank + 1.0, 1.0]).to(cuda), torch.tensor(0.5).to(cuda)
        before = len(emulation.current.host_syncs)  # the copies above are the test's own (pageable memory: a sync)
        layer.load.record(routed, kept=2.0, aux=aux)
        syncs = emulation.current.host_syncs[before:]
        return syncs, moe_metrics(nn.ModuleList([layer]), num_layers=1, num_experts=2, loss_coeff=0.1, iterations=1)

    def _parallel_grads():
        """A tensor-parallel shard (grads rank+1), a replicated parameter (counted on rank 0), an expert shard."""
        split, replicated, expert = (nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2)),
                                     nn.Parameter(torch.zeros(1)))
        split.grad, replicated.grad, expert.grad = torch.full((2,), rank + 1.0), torch.full((2,), 3.0), \
            torch.full((1,), rank + 2.0)
        split.tensor_model_parallel = expert.tensor_model_parallel = True
        expert.allreduce = False
        state = SimpleNamespace(get_model_parallel_rank=lambda: rank, get_model_parallel_world_size=lambda: 2,
                                get_model_parallel_group=lambda: None, get_expert_parallel_world_size=lambda: 2,
                                get_expert_parallel_group=lambda: None)
        return [split, replicated, expert], state

    def grad_norm():
        from megatron.mpu.grad_norm import global_grad_norm

        norm = global_grad_norm(*_parallel_grads())
        return norm.device.type, norm.item()

    def no_host_sync_on_cuda():
        """Gradients on CUDA: the norm and the clipping stay there, nothing waits for the device."""
        from megatron.mpu.grad_norm import clip_grad_norm

        params, state = _parallel_grads()
        marks = ("tensor_model_parallel", "allreduce")
        on_cuda = [SimpleNamespace(grad=p.grad.to(torch.device("cuda", 0)), **{k: getattr(p, k) for k in marks
                                                                                if hasattr(p, k)}) for p in params]
        before = len(emulation.current.host_syncs)
        norm = clip_grad_norm(on_cuda, 1.0, state)
        syncs = emulation.current.host_syncs[before:]
        return norm.device.type, on_cuda[0].grad.device.type, syncs, norm.item()

    def clipping():
        from megatron.mpu.grad_norm import clip_grad_norm

        params, state = _parallel_grads()
        norm = clip_grad_norm(params, 1.0, state)
        return norm.item(), params[0].grad.tolist()

    def optimizer_state_norms():
        from megatron.observability.training_logger import _partitioned_state_norms

        param, flat = nn.Parameter(torch.zeros(2)), torch.zeros(4)
        param._hp_mapping = SimpleNamespace(param_group_index=0,
                                            hp_fragment_address=SimpleNamespace(start=0, numel=2))
        param._dp_group = None
        basic = SimpleNamespace(state={flat: {"exp_avg": torch.full((4,), rank + 1.0)}},
                                param_groups=[{"params": [flat]}])
        return _partitioned_state_norms([("w", param)], basic)

    def debug_sums():
        from megatron.observability.training_logger import gather_debug_sums

        state = SimpleNamespace(get_data_parallel_rank=lambda: 0, get_expert_data_parallel_rank=lambda: 0)
        return gather_debug_sums({f"gradient_norms/w{rank}": [rank + 1.0]}, state)

    def checkpoint_verification():
        from megatron.checkpoint.integrity import MANIFEST
        from megatron.checkpoint.engine import _verified_by_rank0

        path = tempfile.mkdtemp()  # rank 0's manifest lists a file that is not there; rank 1 reads nothing
        if rank == 0:
            with open(os.path.join(path, MANIFEST), "w", encoding="ascii") as manifest:
                manifest.write("0" * 32 + "  missing.pt\n")
        return _verified_by_rank0(path)

    def async_checkpoint():
        from megatron.checkpoint.async_save import AsyncCheckpoints

        writer = SimpleNamespace(take_digests=lambda path: {f"file{rank}": f"digest{rank}"})
        agreed = AsyncCheckpoints._agreed(None, 2 - rank)
        return agreed, AsyncCheckpoints._gathered_digests(SimpleNamespace(writer=writer), "path")

    def build_once():
        from megatron.data.rank_sync import build_once

        return build_once(lambda: None, lambda: True)

    def home_tensors():
        x = host_collectives.broadcast(torch.tensor([10.0 * rank]), src=1)
        host_collectives.barrier()
        return x.tolist(), host_collectives.all_gather(torch.tensor([rank, rank])).tolist()

    checks = (any_rank, check_space, objective_metrics, tokens_per_char, loss_mean, agreed_problem, moe_metrics,
              grad_norm, no_host_sync_on_cuda, clipping, optimizer_state_norms, debug_sums, checkpoint_verification,
              async_checkpoint, build_once, home_tensors)
    return {check.__name__: check for check in checks}


def _under_a_cuda_only_world(rank: int, world_size: int, emulated: bool = True):
    """{check: (result or None, collective calls [(name, device types)], error or None)} of this rank; CUDA
    ``emulated`` on CPU, or the real device."""
    import torch.distributed as dist

    from tests.mpu.emulated_cuda import emulated_cuda_world, real_cuda_world

    assert dist.get_backend() == "cuda:gloo"
    if emulated:
        shadows = {(0, 1): dist.new_group([0, 1], backend="gloo")}
        world = lambda: emulated_cuda_world(shadows)  # noqa: E731
    else:
        torch.cuda.set_device(0)  # both ranks on the one GPU: gloo moves CUDA tensors (NCCL would refuse)
        world = real_cuda_world
    out = {}
    emulation = SimpleNamespace(current=None)
    for name, check in _checks(rank, emulation).items():
        with world() as emulation.current:
            calls = emulation.current.calls
            try:
                out[name] = (check(), list(calls), None)
            except Exception as err:  # noqa: BLE001 (reported per check)
                # a helper that hands a CPU tensor to the group fails on every rank alike: go on with the next
                out[name] = (None, list(calls), f"{type(err).__name__}: {err}")
    return out


EXPECTED = {
    "any_rank": [(True, True)] * 2,
    "check_space": [None] * 2,
    "objective_metrics": [{"accuracy": 0.5, "margin": 2.0}] * 2,
    "tokens_per_char": [9 / 8] * 2,
    "loss_mean": [1.5] * 2,
    "agreed_problem": ["rank 0's finding"] * 2,
    "moe_metrics": [([], {"moe_tokens/layer_00/expert_00": 3.0, "moe_tokens/layer_00/expert_01": 2.0,
                          "moe_dropped/layer_00": pytest.approx(0.2), "moe_load_max/layer_00": pytest.approx(1.2),
                          "moe_aux_loss": pytest.approx(0.05)})] * 2,
    # shared squares 2 + 18 (rank 0) and 8 (rank 1), experts 4 + 9 on both: 20 + 13 + 8 + 13 = 54
    "grad_norm": [("cpu", pytest.approx(math.sqrt(54)))] * 2,
    "no_host_sync_on_cuda": [("cuda", "cuda", [], pytest.approx(math.sqrt(54)))] * 2,
    "clipping": [(pytest.approx(math.sqrt(54)), pytest.approx([(r + 1) / (math.sqrt(54) + 1e-6)] * 2))
                 for r in range(2)],
    "optimizer_state_norms": [{"optimizer_state_norms/w/exp_avg": pytest.approx(math.sqrt(2 + 8))}] * 2,
    "debug_sums": [[{"gradient_norms/w0": [1.0]}, {"gradient_norms/w1": [2.0]}]] * 2,
    "checkpoint_verification": [["missing.pt is missing"]] * 2,
    "async_checkpoint": [(1, (True, {"file0": "digest0", "file1": "digest1"})), (1, (False, {}))],
    "build_once": [False] * 2,
    "home_tensors": [([10.0], [0, 0, 1, 1])] * 2,
}


@pytest.mark.slow
def test_host_side_helpers_hand_cuda_tensors_to_a_cuda_only_group():
    _assert_cuda_only(run_distributed(_under_a_cuda_only_world, world_size=2, backend="cuda:gloo"))


@pytest.mark.gpu
def test_host_side_helpers_hand_real_cuda_tensors_to_a_cuda_only_group():
    """The same on a GPU, without emulation: real CUDA tensors, torch's own sync detection."""
    _assert_cuda_only(run_distributed(_under_a_cuda_only_world, world_size=2, args=(False,), backend="cuda:gloo"))


def _assert_cuda_only(results) -> None:
    failures = []
    for name, expected in EXPECTED.items():
        for rank, result in enumerate(results):
            if name not in result:
                failures.append(f"{name} (rank {rank}): not reached")
                continue
            value, calls, error = result[name]
            devices = {device for _, devices in calls for device in devices}
            if error is not None:
                failures.append(f"{name} (rank {rank}): {error}; collectives {calls}")
            elif not calls or devices != {"cuda"}:
                failures.append(f"{name} (rank {rank}): collectives {calls}, want at least one, all on cuda")
            elif value != expected[rank]:
                failures.append(f"{name} (rank {rank}): {value!r}, want {expected[rank]!r}")
    assert not failures, "\n".join(failures)
