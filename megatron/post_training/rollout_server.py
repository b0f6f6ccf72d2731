"""A rollout server for online REINFORCE (dataset_impl 'online'), built on this project's generation: it samples
completions of prompts from the newest checkpoint of a training run, scores them with a reward function the user
names, and serves them over GPT-NeoX's online-data protocol (megatron.data.online_protocol). tools/rollout_server.py
is its command line.

* The policy: the checkpoint `latest` names in the run's save directory, loaded whole on this process's device
  (any tensor / pipeline split, ZeRO stage, or a LoRA run's adapters merged into their base) and loaded again
  whenever `latest` moves. Until the run has saved one (a fresh REINFORCE run saves its starting weights before its
  first step) a request waits for it. A checkpoint that cannot be read (pruned while being read) leaves the
  previous policy in place until the next request.
* The rollouts: each request takes the next ``prompts_per_request`` prompts of its split (in order, cycling) and
  samples ``completions_per_prompt`` completions of each (SamplingParams; the completion ends with the
  end-of-document token when the model stopped there, as GPT-NeoX's example ends them with its end token).
* The reward: ``reward(prompts, completions) -> rewards``, a Python function the user wrote and names as
  ``module:function`` (importable from the current directory or PYTHONPATH): lists of strings, one pair per
  completion, the prompt repeated for each of its completions; one number per completion.

Requests are answered one at a time, one connection each, so the server outlives any number of trainer restarts,
and every data-parallel rank may ask the same server.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
import socket
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron.checkpoint.format import read_latest
from megatron.checkpoint.lora import read_model_checkpoint
from megatron.data.online_protocol import SPLITS, RolloutGroup, encode_rollouts
from megatron.errors import ConfigError
from megatron.inference.loading import load_model_weights
from megatron.inference.text_generation import (SamplingParams, SequentialRunner, generate_tokens,
                                                max_sequence_length)
from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from megatron.tokenizer.build_tokenizer import build_tokenizer_from

RewardFunction = Callable[[List[str], List[str]], Sequence[float]]
REWARD_FLAG = "--reward"


def load_reward(entry_point: str, flag: str = REWARD_FLAG) -> RewardFunction:
    """The function ``module:function`` names; ConfigError naming ``flag`` and the entry point when it cannot be
    imported or called with (prompts, completions)."""
    module_name, _, function_name = entry_point.partition(":")
    if not module_name or not function_name:
        raise ConfigError([f"{flag} {entry_point!r}: give the reward function as module:function (e.g. "
                           f"my_rewards:score, with my_rewards.py in the current directory or on PYTHONPATH)"])
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module: any error while importing it
        raise ConfigError([f"{flag} {entry_point!r}: cannot import {module_name!r} ({type(err).__name__}: {err}); "
                           f"put it in the current directory or on PYTHONPATH"]) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError([f"{flag} {entry_point!r}: {module_name} has no function {function_name!r}"])
    try:
        inspect.signature(function).bind([], [])
    except TypeError:
        raise ConfigError([f"{flag} {entry_point!r}: the reward function must take (prompts, completions), two lists "
                           f"of strings, and return one number per completion"]) from None
    except ValueError:
        pass  # no signature to inspect (a builtin): called as it is
    return function


def scored(reward: RewardFunction, entry_point: str, prompts: List[str], completions: List[str]) -> List[float]:
    """The reward function's numbers for the completions; ConfigError naming it when it fails or answers wrongly."""
    try:
        values = reward(prompts, completions)
        numbers = [float(v) for v in values]
    except Exception as err:  # the user's function: any failure, said with its name
        raise ConfigError([f"{REWARD_FLAG} {entry_point!r} failed on {len(completions)} completions "
                           f"({type(err).__name__}: {err})"]) from None
    if len(numbers) != len(completions) or not all(math.isfinite(n) for n in numbers):
        raise ConfigError([f"{REWARD_FLAG} {entry_point!r} returned {len(numbers)} values for {len(completions)} "
                           f"completions: it must return one finite number per completion"])
    return numbers


@dataclasses.dataclass
class RolloutSettings:
    """How each request's rollouts are made (tools/rollout_server.py's flags)."""

    prompts_per_request: int = 8
    completions_per_prompt: int = 4
    max_new_tokens: int = 32
    sampling: SamplingParams = SamplingParams(temperature=1.0)
    seed: int = 1234


class Policy:
    """The newest checkpoint of a run's save directory, as a model ready to generate on ``device``."""

    def __init__(self, save_dir: str, device: str = "cpu", tokenizer_overrides: Optional[Dict[str, str]] = None,
                 say: Callable[[str], None] = print) -> None:
        self.save_dir, self.device, self.say = save_dir, torch.device(device), say
        self.tokenizer_overrides = {k: v for k, v in (tokenizer_overrides or {}).items() if v}
        self.tag: Optional[str] = None
        self.runner = self.tokenizer = self.config = None

    def refresh(self, wait_seconds: float = 1.0) -> None:
        """Load the checkpoint `latest` names if it is not the one loaded; with none yet, wait for one."""
        waited = False
        while True:
            tag = read_latest(self.save_dir)
            if tag is not None and tag != self.tag:
                try:
                    self._load(tag)
                    return
                except Exception as err:  # a checkpoint pruned or rewritten while read fails in any of its readers
                    if self.runner is None or isinstance(err, ConfigError):
                        raise
                    self.say(f"rollout server: could not load {tag} ({type(err).__name__}: {err}); still sampling "
                             f"from {self.tag}")
                    return
            if tag is not None or self.runner is not None:
                return
            if not waited:
                self.say(f"rollout server: waiting for a checkpoint in {self.save_dir} (the trainer saves its "
                         f"starting weights before its first step)")
                waited = True
            time.sleep(wait_seconds)

    def _load(self, tag: str) -> None:
        path = os.path.join(self.save_dir, tag)
        checkpoint = read_model_checkpoint(path)
        config = checkpoint.config.replace(model_parallel_size=1, pipe_parallel_size=0, sequence_parallel=False,
                                           moe_expert_parallel_size=1, lora=None,
                                           precision="fp32" if self.device.type == "cpu" and
                                           checkpoint.config.precision == "fp16" else checkpoint.config.precision)
        state = SingleProcessState()
        model = build_model(config, state).to(self.device)
        load_model_weights(model, checkpoint.path, state, config, checkpoint=checkpoint)
        if self.tokenizer is None:
            args = {**checkpoint.args, **self.tokenizer_overrides}
            self.tokenizer = build_tokenizer_from(args.get("tokenizer_type"), args.get("vocab_file"),
                                                  args.get("merge_file"))
        self.runner, self.config, self.tag = SequentialRunner(model.eval(), state), config, tag
        self.say(f"rollout server: sampling from {path}")


class RolloutMaker:
    """Each split's prompts in turn, sampled by the policy and scored by the reward function."""

    def __init__(self, policy: Policy, reward: RewardFunction, reward_name: str, prompts: Sequence[str],
                 settings: RolloutSettings) -> None:
        self.policy, self.reward, self.reward_name, self.settings = policy, reward, reward_name, settings
        self.prompts = list(prompts) or [""]  # "": unconditional, from the end-of-document token
        self.next_prompt = {split: 0 for split in SPLITS}
        self.generator: Optional[torch.Generator] = None

    def take_prompts(self, split: str) -> List[str]:
        start, n = self.next_prompt[split], self.settings.prompts_per_request
        self.next_prompt[split] = (start + n) % len(self.prompts)
        return [self.prompts[(start + i) % len(self.prompts)] for i in range(n)]

    def rollouts(self, split: str) -> List[RolloutGroup]:
        self.policy.refresh()
        tokenizer, settings = self.policy.tokenizer, self.settings
        if self.generator is None:
            self.generator = torch.Generator(device=self.policy.device).manual_seed(settings.seed)
        texts = self.take_prompts(split)
        prefixes = [tokenizer.tokenize(text) if text else [tokenizer.eod] for text in texts]
        n = settings.completions_per_prompt
        rows = [prefix for prefix in prefixes for _ in range(n)]
        results = generate_tokens(self.policy.runner, rows, eod=tokenizer.eod, maximum_tokens=settings.max_new_tokens,
                                  max_seq_length=max_sequence_length(self.policy.config), params=settings.sampling,
                                  generator=self.generator, vocab_size=tokenizer.vocab_size,
                                  device=self.policy.device)
        completions = [r.tokens + ([tokenizer.eod] if r.finished else []) for r in results]
        rewards = scored(self.reward, self.reward_name, [t for t in texts for _ in range(n)],
                         [tokenizer.detokenize(r.tokens) for r in results])
        return [RolloutGroup(prefix=results[i * n].prompt, completions=completions[i * n:(i + 1) * n],
                             rewards=rewards[i * n:(i + 1) * n]) for i in range(len(texts))]


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (SO_REUSEADDR: a restarted server takes its port back at once)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind((host, port))
    except OSError as err:
        server.close()
        raise ConfigError([f"--host {host} --port {port}: cannot listen there ({err}); pick a free port and set "
                           f"online_dataserver_ports to it"]) from None
    server.listen(16)
    return server


def serve(server: socket.socket, maker: RolloutMaker, say: Callable[[str], None] = print,
          max_requests: Optional[int] = None) -> None:
    """Answer requests (module docstring) until ``max_requests`` have been answered (None: forever)."""
    answered = 0
    while max_requests is None or answered < max_requests:
        connection, peer = server.accept()
        with connection:
            connection.settimeout(60.0)
            try:
                split = connection.recv(4096).decode("utf-8", errors="replace").strip()
            except OSError:
                continue
            if split not in SPLITS:
                say(f"rollout server: {peer[0]}:{peer[1]} asked for {split[:40]!r}, not one of {', '.join(SPLITS)}")
                continue
            groups = maker.rollouts(split)
            try:
                connection.sendall(encode_rollouts(groups))
            except OSError as err:
                say(f"rollout server: {peer[0]}:{peer[1]} left before its rollouts were sent ({err})")
                continue
        answered += 1
        rewards = [r for g in groups for r in g.rewards]
        say(f"rollout server: sent {len(rewards)} {split} rollouts from {maker.policy.tag}, mean reward "
            f"{sum(rewards) / len(rewards):.4f}")
