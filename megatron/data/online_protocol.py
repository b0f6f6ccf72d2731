"""GPT-NeoX's online-data wire protocol (dataset_impl 'online'), both ends, so that a rollout server written for
GPT-NeoX serves this project's trainer and this project's server (megatron.post_training.rollout_server) serves
GPT-NeoX's.

One request per TCP connection: the trainer connects to the server, sends the name of the split it wants
("train", "valid" or "test", UTF-8, nothing else), and reads until the server closes the connection. The server
answers with one pickle of a list of rollout groups, each a dict

    {"prefix": [token ids of the prompt], "completions": [[token ids], ...], "rewards": [float, ...]}

one reward per completion (GPT-NeoX's post-training/online_data_example_llama3.py). Nothing carries the
sampler's log-probabilities: REINFORCE here, as in GPT-NeoX, is on-policy and reads only the rewards.

Pickle runs code named in the payload; the trainer unpickles the answer with no classes or functions allowed
(RolloutUnpickler): lists, dicts, strings, ints and floats only, and numpy scalars (a reward computed with numpy),
so a server (or anything else listening on that port) cannot run code in the trainer.
"""

from __future__ import annotations

import io
import pickle
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from megatron.errors import DataError

SPLITS = ("train", "valid", "test")
ADDRESS_KEYS = "online_dataserver_ips / online_dataserver_ports"
RECEIVE_CHUNK = 1 << 16
ALLOWED_GLOBALS = {("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "dtype")}
"""What a rollout payload may name: numpy's scalar constructor and dtype (a numpy float as a reward)."""


@dataclass(frozen=True)
class RolloutGroup:
    """One prompt's rollouts: the prompt's token ids, the completions' token ids and their rewards."""

    prefix: List[int]
    completions: List[List[int]]
    rewards: List[float]

    def to_wire(self) -> Dict[str, Any]:
        return {"prefix": list(self.prefix), "completions": [list(c) for c in self.completions],
                "rewards": [float(r) for r in self.rewards]}


class BrokenAnswer(DataError):
    """An answer cut short or garbled (a server that died while sending): worth asking again."""


class ForbiddenGlobal(pickle.UnpicklingError):
    """A payload that names a class or function (RolloutUnpickler refuses it)."""


class RolloutUnpickler(pickle.Unpickler):
    """Unpickles plain data only (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise ForbiddenGlobal(f"the payload names {module}.{name}; rollouts must be plain lists, dicts, "
                                     f"ints and floats (send float(reward) and list(token ids))")


def decode_rollouts(payload: bytes, where: str) -> List[RolloutGroup]:
    """The rollout groups of one answer; DataError naming ``where`` (the server) when it is not the protocol's."""
    try:
        groups = RolloutUnpickler(io.BytesIO(payload)).load()
    except ForbiddenGlobal as err:
        raise DataError(f"the online data server {where} sent rollouts that are not plain data: {err}") from None
    except Exception as err:  # a truncated or garbled payload: any other unpickling failure
        raise BrokenAnswer(f"the online data server {where} sent {len(payload)} bytes that are not a pickled list "
                           f"of rollouts ({type(err).__name__}: {err})") from None
    if not isinstance(groups, list):
        raise DataError(f"the online data server {where} sent a {type(groups).__name__}, not a list of rollout "
                        f"groups {{'prefix', 'completions', 'rewards'}}")
    return [_group(group, where, index) for index, group in enumerate(groups)]


def _token_ids(value: Any) -> Optional[List[int]]:
    if not isinstance(value, (list, tuple)):
        return None
    try:
        ids = [int(t) for t in value]
    except (TypeError, ValueError):
        return None
    return ids if all(i >= 0 for i in ids) else None


def _group(group: Any, where: str, index: int) -> RolloutGroup:
    what = f"rollout group {index} from the online data server {where}"
    if not isinstance(group, dict) or not {"prefix", "completions", "rewards"} <= set(group):
        keys = sorted(group) if isinstance(group, dict) else type(group).__name__
        raise DataError(f"{what} must be a dict with 'prefix', 'completions' and 'rewards', got {keys}")
    prefix = _token_ids(group["prefix"])
    completions = [_token_ids(c) for c in group["completions"]] if isinstance(group["completions"], list) else None
    if prefix is None or completions is None or any(c is None for c in completions):
        raise DataError(f"{what}: 'prefix' must be a list of token ids and 'completions' a list of such lists")
    try:
        rewards = [float(r) for r in group["rewards"]]
    except (TypeError, ValueError):
        raise DataError(f"{what}: 'rewards' must be a list of numbers, got {group['rewards']!r}") from None
    if len(rewards) != len(completions) or not completions:
        raise DataError(f"{what} has {len(completions)} completions and {len(rewards)} rewards: one reward per "
                        f"completion, at least one")
    return RolloutGroup(prefix, completions, rewards)


def encode_rollouts(groups: Sequence[RolloutGroup]) -> bytes:
    """The server's answer: a pickle of the groups as plain lists and dicts (GPT-NeoX's format)."""
    return pickle.dumps([g.to_wire() for g in groups], protocol=4)


def server_address(ips: Union[str, Sequence[str]], ports: Union[int, Sequence[int]], data_parallel_rank: int
                   ) -> tuple:
    """(ip, port) that data-parallel rank ``data_parallel_rank`` asks: one value for every rank, or a list with one
    entry per data-parallel rank (as GPT-NeoX indexes them)."""
    ip = ips if isinstance(ips, str) else ips[data_parallel_rank]
    port = ports if isinstance(ports, int) else ports[data_parallel_rank]
    return str(ip), int(port)


def request_once(address: tuple, split: str, timeout: float) -> bytes:
    """One request: connect, send the split's name, read until the server closes."""
    with socket.create_connection(address, timeout=timeout) as connection:
        connection.sendall(split.encode("utf-8"))
        chunks = []
        while True:
            chunk = connection.recv(RECEIVE_CHUNK)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def fetch_rollouts(address: tuple, split: str, *, retry_seconds: float = 600.0, timeout: float = 600.0,
                   say: Callable[[str], None] = print, request: Callable[..., bytes] = request_once
                   ) -> List[RolloutGroup]:
    """The next rollout groups from the server at ``address`` for ``split``. A server that cannot be reached, hangs
    up early or answers nothing is asked again (said on each try, waiting 1, 2, 4, then 5 s between tries)
    until ``retry_seconds`` have passed since the first failure: a rollout server restarting (e.g. to load new
    code) does not end the run. Then DataError names the address and the keys that set it."""
    where = f"{address[0]}:{address[1]}"
    started, wait, attempt = time.monotonic(), 1.0, 0
    while True:
        attempt += 1
        try:
            payload = request(address, split, timeout)
            if payload:
                return decode_rollouts(payload, where)
            problem = "closed the connection without sending rollouts"
        except OSError as err:
            problem = f"is not reachable ({type(err).__name__}: {err})"
        except BrokenAnswer as err:
            problem = f"sent a broken answer ({err})"
        waited = time.monotonic() - started
        if waited >= retry_seconds:
            raise DataError(f"the online data server {where} (set by {ADDRESS_KEYS}) {problem}; gave up after "
                            f"{attempt} tries in {waited:.0f} s: start the rollout server (tools/rollout_server.py "
                            f"--port {address[1]}) or point {ADDRESS_KEYS} at it")
        say(f"online data server {where} ({ADDRESS_KEYS}) {problem}; retrying in {wait:.0f} s (try {attempt}, "
            f"giving up after {retry_seconds:.0f} s)")
        time.sleep(wait)
        wait = min(wait * 2, 5.0)
