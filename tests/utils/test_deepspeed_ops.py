"""TORCH_CUDA_ARCH_LIST made parsable for DeepSpeed's JIT builder while it builds an op, and restored after."""

import pytest

from megatron.utils.deepspeed_ops import ARCH_LIST_VARIABLE, arch_list_deepspeed_can_parse, deepspeed_arch_list


@pytest.mark.parametrize("value, expected", [
    ("9.0a", "9.0"),  # the first H200 run's entry: DeepSpeed 0.19.8 died on int('0a')
    ("8.0 8.6;9.0a+PTX", "8.0;8.6;9.0+PTX"),
    ("10.0f;12.0a;9.0", "10.0;12.0;9.0"),
    ("9.0;9.0a", "9.0"),
    (" 8.0 ;; Hopper ", "8.0"),
    ("Hopper", None),
    ("7.5;8.0+PTX", "7.5;8.0+PTX"),
])
def test_arch_list_entries_lose_what_deepspeed_cannot_parse(value, expected):
    assert deepspeed_arch_list(value) == expected


def _deepspeed_sort_key(entry: str):
    """DeepSpeed 0.19.8's parse of a JIT arch entry (op_builder/builder.py compute_capability_args)."""
    return tuple(int(part.split("+")[0]) for part in entry.split("."))


def test_deepspeed_parses_every_cleaned_entry():
    with pytest.raises(ValueError, match="0a"):
        _deepspeed_sort_key("9.0a")
    for entry in deepspeed_arch_list("8.0 9.0a 10.0f+PTX 12.1a").split(";"):
        _deepspeed_sort_key(entry)


def test_the_users_value_comes_back_even_when_the_build_fails():
    environ = {ARCH_LIST_VARIABLE: "8.0;9.0a"}
    with pytest.raises(RuntimeError, match="build failed"):
        with arch_list_deepspeed_can_parse(environ):
            assert environ[ARCH_LIST_VARIABLE] == "8.0;9.0"
            raise RuntimeError("build failed")
    assert environ == {ARCH_LIST_VARIABLE: "8.0;9.0a"}
    with arch_list_deepspeed_can_parse(environ := {ARCH_LIST_VARIABLE: "Hopper"}):
        assert ARCH_LIST_VARIABLE not in environ  # DeepSpeed then builds for the devices' own capabilities
    assert environ == {ARCH_LIST_VARIABLE: "Hopper"}
    with arch_list_deepspeed_can_parse(environ := {}):
        assert environ == {}
    assert environ == {}
