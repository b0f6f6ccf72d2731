"""REINFORCE's pieces on fixed rollouts, no processes: each kl_impl's KL term and the loss equal their closed forms
(written out element by element), the leave-one-out and moving-average baselines, the samples the online dataset
makes, the online-data protocol (plain data only, a clear error naming the server and the keys), and the reward
entry point's errors."""

import math
import pickle
import socket

import numpy as np
import pytest
import torch

from megatron.data.online_dataset import MovingAverageBaseline, OnlineDataset, leave_one_out_advantages
from megatron.data.online_protocol import (RolloutGroup, decode_rollouts, encode_rollouts, fetch_rollouts,
                                           server_address)
from megatron.errors import ConfigError, DataError
from megatron.post_training.reinforce import ReinforceLoss, kl_penalty, reinforce_loss
from megatron.post_training.rollout_server import load_reward, scored

ROWS, SEQ, VOCAB = 3, 4, 5


def fixed_rollouts():
    generator = torch.Generator().manual_seed(7)
    policy = torch.randn(ROWS, SEQ, VOCAB, generator=generator)
    reference = torch.randn(ROWS, SEQ, VOCAB, generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.float32)
    advantages = torch.tensor([1.5, -0.5, -1.0])
    raw = torch.tensor([3.0, 1.0, 0.5])
    return policy, reference, labels, mask, advantages, raw


def log_softmax_by_hand(logits, row, t):
    values = [float(v) for v in logits[row, t]]
    top = max(values)
    total = top + math.log(sum(math.exp(v - top) for v in values))
    return [v - total for v in values]


def closed_form_kl(kind, policy, reference, labels, row, t):
    p, q = log_softmax_by_hand(policy, row, t), log_softmax_by_hand(reference, row, t)
    d = p[int(labels[row, t])] - q[int(labels[row, t])]
    return {"kl": d, "abs": abs(d), "mse": d * d / 2,
            "full": sum(math.exp(pv) * (pv - qv) for pv, qv in zip(p, q))}[kind]


def closed_form_loss(kind, beta, policy, reference, labels, mask, advantages):
    """GPT-NeoX's: sum over each row's completion tokens of (-A log p + beta KL), divided by the micro-batch's token
    count, averaged over rows."""
    tokens = float(mask.sum())
    rows = []
    for row in range(ROWS):
        total = 0.0
        for t in range(SEQ):
            if mask[row, t]:
                logp = log_softmax_by_hand(policy, row, t)[int(labels[row, t])]
                kl = closed_form_kl(kind, policy, reference, labels, row, t) if beta else 0.0
                total += -float(advantages[row]) * logp + beta * kl
        rows.append(total / tokens)
    return sum(rows) / ROWS


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "full"])
def test_each_kl_impl_equals_its_closed_form(kind):
    policy, reference, labels, *_ = fixed_rollouts()
    if kind == "full":
        got = kl_penalty(kind, policy.log_softmax(-1), reference.log_softmax(-1))
    else:
        pick = lambda logits: logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        got = kl_penalty(kind, pick(policy), pick(reference))
    want = torch.tensor([[closed_form_kl(kind, policy, reference, labels, r, t) for t in range(SEQ)]
                         for r in range(ROWS)])
    assert torch.allclose(got, want, atol=1e-6), (kind, got, want)
    if kind == "full":  # and it is KL(p || q) as torch.distributions computes it
        exact = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=policy),
                                                  torch.distributions.Categorical(logits=reference))
        assert torch.allclose(got, exact, atol=1e-6)


@pytest.mark.parametrize("kind,beta", [("kl", 0.1), ("abs", 0.3), ("mse", 0.2), ("full", 0.5), ("mse", 0.0)])
def test_the_loss_with_its_kl_term_equals_the_closed_form(kind, beta):
    """Through ReinforceLoss as the model calls it: logits, and the labels tuple the batches carry (the reference's
    label log-probabilities, or its whole log-softmax for 'full'; none when kl_div_beta is 0)."""
    policy, reference, labels, mask, advantages, raw = fixed_rollouts()
    loss_fn = ReinforceLoss(kind, beta, fp32=True)
    if beta == 0:
        extra = ()
    elif kind == "full":
        extra = (reference.log_softmax(-1),)
    else:
        extra = (reference.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1),)
    logits = policy.clone().requires_grad_(True)
    loss = loss_fn(logits, (labels, mask, advantages, raw, *extra))
    want = closed_form_loss(kind, beta, policy, reference, labels, mask, advantages)
    assert abs(float(loss.detach()) - want) < 1e-6, (float(loss.detach()), want)
    loss.backward()
    assert logits.grad is not None and float(logits.grad[mask == 0].abs().sum()) == 0.0  # prompt tokens: no gradient
    metrics = loss_fn.take_metrics()
    assert metrics["reward"] == pytest.approx(float(raw.mean())) and metrics["reward_std"] == pytest.approx(
        float(raw.std()))
    assert ("kl" in metrics) == (beta > 0)


def test_the_loss_without_a_reference_is_the_policy_gradient_alone():
    policy, _, labels, mask, advantages, _ = fixed_rollouts()
    logps = policy.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    want = float(((-logps * advantages.view(-1, 1) * mask).sum(-1) / mask.sum()).mean())
    assert float(reinforce_loss(logps, advantages, mask)) == pytest.approx(want, abs=1e-7)


def test_leave_one_out_subtracts_the_mean_of_the_other_completions():
    rewards = [1.0, 2.0, 3.0, 6.0]
    want = [1 - (2 + 3 + 6) / 3, 2 - (1 + 3 + 6) / 3, 3 - (1 + 2 + 6) / 3, 6 - (1 + 2 + 3) / 3]
    assert leave_one_out_advantages(rewards) == pytest.approx(want)
    assert sum(leave_one_out_advantages(rewards)) == pytest.approx(0.0)  # RLOO's advantages sum to zero
    assert leave_one_out_advantages([4.0]) == [4.0]


def test_the_moving_average_baseline_is_the_mean_of_earlier_group_means():
    baseline = MovingAverageBaseline(size=2)
    assert baseline.advantages([1.0, 3.0]) == [1.0, 3.0]  # nothing before: baseline 0
    assert baseline.advantages([5.0]) == [5.0 - 2.0]  # the first group's mean
    assert baseline.advantages([0.0, 2.0]) == [-3.5, -1.5]  # mean of 2 and 5
    assert baseline.advantages([0.0]) == [-3.0]  # the oldest mean (2) left the window: mean of 5 and 1


def test_the_online_dataset_masks_the_prompt_pads_and_cuts_to_the_sequence_length():
    groups = [RolloutGroup([7, 8], [[1, 2, 3], [4]], [2.0, 0.0]), RolloutGroup([9] * 5, [[5, 6]], [1.0])]
    fetched = []
    dataset = OnlineDataset(num_samples=100, seq_length=5, address=("127.0.0.1", 1), leave_one_out=True,
                            fetch=lambda: fetched.append(1) or groups)
    first, second, third = dataset[0], dataset[57], dataset[3]
    assert first["text"].tolist() == [7, 8, 1, 2, 3, 0] and first["label"].tolist() == [-100, -100, 1, 2, 3, -100]
    assert second["text"].tolist() == [7, 8, 4, 0, 0, 0] and second["label"].tolist() == [-100, -100, 4] + [-100] * 3
    assert (float(first["reward"][0]), float(second["reward"][0])) == (2.0, -2.0)  # leave-one-out over 2
    assert float(first["raw_reward"][0]) == 2.0
    assert third["text"].tolist() == [9] * 5 + [5] and third["label"].tolist() == [-100] * 5 + [5]  # cut to 6
    assert len(fetched) == 1 and len(dataset) == 100
    dataset[0]
    assert len(fetched) == 2  # the queue ran out: the next rollouts are fetched


@pytest.mark.attack("a rollout server answering with a pickle that runs a function in the trainer")
def test_rollouts_cross_the_wire_as_plain_data_and_nothing_else_is_unpickled():
    groups = [RolloutGroup([1, 2], [[3], [4, 5]], [0.5, np.float64(1.5)])]
    assert decode_rollouts(encode_rollouts(groups), "here") == [RolloutGroup([1, 2], [[3], [4, 5]], [0.5, 1.5])]
    numpy_reward = pickle.dumps([{"prefix": [1], "completions": [[2]], "rewards": [np.float32(0.25)]}])
    assert decode_rollouts(numpy_reward, "here")[0].rewards == [0.25]  # a reward computed with numpy is fine

    class Planted:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(DataError, match="server 10.0.0.1:9 sent rollouts that are not plain data: .*builtins.print"):
        decode_rollouts(pickle.dumps([Planted()]), "10.0.0.1:9")
    with pytest.raises(DataError, match="has 2 completions and 1 rewards"):
        decode_rollouts(pickle.dumps([{"prefix": [1], "completions": [[2], [3]], "rewards": [1.0]}]), "x")
    assert server_address(["a", "b"], [10000, 10001], 1) == ("b", 10001)
    assert server_address("a", 10000, 3) == ("a", 10000)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_cannot_be_reached_is_named_with_the_keys_that_point_at_it():
    port = closed_port()
    said = []
    with pytest.raises(DataError) as err:
        fetch_rollouts(("127.0.0.1", port), "train", retry_seconds=0.0, say=said.append)
    text = str(err.value)
    assert f"127.0.0.1:{port}" in text and "online_dataserver_ips / online_dataserver_ports" in text
    assert "not reachable" in text and "tools/rollout_server.py" in text


def test_a_server_that_comes_back_is_asked_again_with_a_message(monkeypatch):
    monkeypatch.setattr("megatron.data.online_protocol.time.sleep", lambda seconds: None)
    answers = [ConnectionRefusedError("refused"), b"", encode_rollouts([RolloutGroup([1], [[2]], [1.0])])]

    def request(address, split, timeout):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    said = []
    groups = fetch_rollouts(("127.0.0.1", 10000), "train", say=said.append, request=request)
    assert groups == [RolloutGroup([1], [[2]], [1.0])]
    assert len(said) == 2 and "127.0.0.1:10000" in said[0] and "retrying" in said[0]
    assert "closed the connection without sending rollouts" in said[1]


def test_reward_entry_points_are_checked_and_named(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompts, completions):\n    return [len(c) for c in completions]\n"
        "def one_arg(prompts):\n    return []\n"
        "def wrong(prompts, completions):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    score = load_reward("my_rewards:score")
    assert scored(score, "my_rewards:score", ["p", "p"], ["ab", "abc"]) == [2.0, 3.0]
    for entry, needle in [("my_rewards", "give the reward function as module:function"),
                          ("no_such_module_here:f", "cannot import 'no_such_module_here'"),
                          ("my_rewards:absent", "my_rewards has no function 'absent'"),
                          ("my_rewards:one_arg", "must take (prompts, completions)")]:
        with pytest.raises(ConfigError, match="--reward") as err:
            load_reward(entry)
        assert entry in str(err.value) and needle in str(err.value)
    example = "megatron.post_training.example_rewards:letter_e_count"  # the worked example's (docs/post-training.md)
    assert scored(load_reward(example), example, ["", ""], ["even", "x"]) == [2.0, 0.0]
    with pytest.raises(ConfigError, match="'my_rewards:wrong' returned 1 values for 2 completions"):
        scored(load_reward("my_rewards:wrong"), "my_rewards:wrong", ["p", "p"], ["a", "b"])


def test_gpt_neox_style_peers_interoperate_with_ours():
    """A server written as GPT-NeoX's post-training/online_data_example_llama3.py writes one (bind, accept, one recv of
    the split, send a pickle of plain dicts, close) serves our trainer's fetch; our server loop answers a client
    written as GPT-NeoX's OnlineDataset.update_online_batches (send the split, recv until closed, pickle.loads)."""
    import threading

    from megatron.post_training.rollout_server import listening_socket, serve

    theirs = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    theirs.bind(("127.0.0.1", 0))
    theirs.listen(1)
    asked = []

    def their_server():
        conn, _ = theirs.accept()
        asked.append(conn.recv(4096).decode())
        conn.send(pickle.dumps([{"prefix": [1, 2], "completions": [[3], [4, 5]], "rewards": [0.5, 1.0]}]))
        conn.close()

    thread = threading.Thread(target=their_server)
    thread.start()
    groups = fetch_rollouts(theirs.getsockname(), "valid", retry_seconds=0.0)
    thread.join(timeout=10)
    theirs.close()
    assert asked == ["valid"] and groups == [RolloutGroup([1, 2], [[3], [4, 5]], [0.5, 1.0])]

    class Maker:  # what serve reads of a RolloutMaker
        policy = type("Policy", (), {"tag": "global_step7"})()

        def rollouts(self, split):
            return [RolloutGroup([9], [[8, 7], [6]], [2.0, 0.0])] if split == "train" else []

    ours = listening_socket("127.0.0.1", 0)
    said = []
    thread = threading.Thread(target=serve, args=(ours, Maker()), kwargs={"say": said.append, "max_requests": 1})
    thread.start()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.connect(ours.getsockname())
    client.send("train".encode())
    data = b""
    while True:
        chunk = client.recv(4096)
        if not chunk:
            break
        data += chunk
    client.close()
    thread.join(timeout=10)
    ours.close()
    assert pickle.loads(data) == [{"prefix": [9], "completions": [[8, 7], [6]], "rewards": [2.0, 0.0]}]
    assert said == ["rollout server: sent 2 train rollouts from global_step7, mean reward 1.0000"]


def test_the_server_tool_names_a_bad_reward_entry_point_and_exits_2(tmp_path, capsys):
    from tests.tools.tool_runner import load_tool

    tool = load_tool("tools/rollout_server.py")
    assert tool.main(["--save", str(tmp_path), "--reward", "no_such_rewards:score", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--reward 'no_such_rewards:score': cannot import 'no_such_rewards'" in err
    assert tool.main(["--save", str(tmp_path), "--reward", "megatron.post_training.example_rewards:letter_e_count",
                      "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "--prompts" in capsys.readouterr().err


def _tensor_parallel_losses(rank: int, world_size: int):
    """Each kl_impl's loss and logits gradient from this rank's vocabulary shard (tensor parallel over the world)."""
    import torch.distributed as dist

    policy, reference, labels, mask, advantages, raw = fixed_rollouts()
    policy = torch.cat([policy, policy[..., :1] - 1.0], dim=-1)  # 6 ids: 3 per rank
    reference = torch.cat([reference, reference[..., :1]], dim=-1)
    shard = slice(3 * rank, 3 * rank + 3)
    out = {}
    for kind in ("kl", "abs", "mse", "full"):
        whole = reference.log_softmax(-1)
        extra = whole if kind == "full" else whole.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        logits = policy[..., shard].clone().requires_grad_(True)
        loss = ReinforceLoss(kind, 0.2, fp32=True, group=dist.group.WORLD)(logits, (labels, mask, advantages, raw,
                                                                                   extra))
        loss.backward()
        out[kind] = (float(loss.detach()), logits.grad)
    return out


def test_the_loss_under_tensor_parallelism_equals_one_rank():
    """The vocabulary split over two ranks (the head's shards): the same loss, and each rank's share of the gradient,
    for every kl_impl ('full' gathers the shards; the others take the vocabulary-parallel cross entropy)."""
    from tests.distributed_helpers import run_distributed

    policy, reference, labels, mask, advantages, raw = fixed_rollouts()
    policy = torch.cat([policy, policy[..., :1] - 1.0], dim=-1)
    reference = torch.cat([reference, reference[..., :1]], dim=-1)
    ranks = run_distributed(_tensor_parallel_losses, world_size=2)
    for kind in ("kl", "abs", "mse", "full"):
        whole = reference.log_softmax(-1)
        extra = whole if kind == "full" else whole.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        logits = policy.clone().requires_grad_(True)
        loss = ReinforceLoss(kind, 0.2, fp32=True)(logits, (labels, mask, advantages, raw, extra))
        loss.backward()
        for rank, result in enumerate(ranks):
            got_loss, got_grad = result[kind]
            assert got_loss == pytest.approx(float(loss.detach()), abs=1e-6), (kind, rank, got_loss, float(loss))
            assert torch.allclose(got_grad, logits.grad[..., 3 * rank:3 * rank + 3], atol=1e-6), (kind, rank)


def test_the_server_follows_latest_and_keeps_its_policy_when_a_checkpoint_cannot_be_read(tmp_path):
    """The rollout server's policy: the checkpoint `latest` names, loaded again when it moves; one that cannot be read
    (pruned while being read, or damaged) is said and the previous policy kept; rollouts have the requested shape and
    the reward function's scores."""
    from megatron.checkpoint.neox_checkpoint import flat_state_dict, write_checkpoint
    from megatron.inference.text_generation import SamplingParams
    from megatron.model.config import ModelConfig
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState
    from megatron.post_training.rollout_server import Policy, RolloutMaker, RolloutSettings

    args = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=24, max_position_embeddings=24,
                padded_vocab_size=512, tokenizer_type="CharLevelTokenizer")
    config = ModelConfig(**{k: v for k, v in args.items() if k != "tokenizer_type"})
    save = tmp_path / "save"

    def checkpoint(iteration: int, seed: int) -> None:
        torch.manual_seed(seed)
        state = flat_state_dict(build_model(config, SingleProcessState()).state_dict(), config)
        write_checkpoint(str(save), state, config, args, {}, iteration)

    checkpoint(1, seed=1)
    said = []
    policy = Policy(str(save), say=said.append)
    maker = RolloutMaker(policy, lambda prompts, completions: [float(len(c)) for c in completions], "length",
                         ["ab", "c"], RolloutSettings(prompts_per_request=3, completions_per_prompt=2,
                                                      max_new_tokens=5, sampling=SamplingParams(temperature=1.0)))
    groups = maker.rollouts("train")
    assert policy.tag == "global_step1" and [g.prefix for g in groups] == [[97, 98], [99], [97, 98]]
    assert all(len(g.completions) == 2 and 1 <= len(c) <= 5 for g in groups for c in g.completions)
    tokenizer = policy.tokenizer  # the reward saw the detokenized completions (EOD, if sampled, is not text)
    assert all(r == float(len(tokenizer.detokenize([t for t in c if t != tokenizer.eod])))
               for g in groups for c, r in zip(g.completions, g.rewards))

    (save / "global_step2").mkdir()
    (save / "latest").write_text("global_step2")  # names a checkpoint with no files
    maker.rollouts("train")
    assert policy.tag == "global_step1" and "could not load global_step2" in said[-1]
    checkpoint(3, seed=3)
    maker.rollouts("valid")
    assert policy.tag == "global_step3" and said[-1].endswith("global_step3")
