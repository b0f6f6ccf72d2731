"""Careless and hostile text files (issue 32, items 11, 13, 14): a YAML alias bomb, a recursive alias, a file nested
200,000 levels deep and a file that is not UTF-8 each give one sentence naming the file (and the byte), quickly,
instead of gigabytes then MemoryError, a RecursionError or a UnicodeDecodeError traceback."""

import time

import pytest

from megatron.data.document_readers import iter_documents, iter_json_records
from megatron.errors import ConfigError, DataError
from megatron.utils.text_files import decode_utf8, parse_json, read_json, read_utf8
from megatron.utils.yaml_text import MAX_DEPTH, MAX_EXPANDED_NODES, parse_yaml_text


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """The billion-laughs document: each level a list of `width` aliases of the level below (width**levels values in
    a few hundred bytes), under deepspeed_extra_args, where the issue planted it."""
    lines = ["deepspeed_extra_args:", f"  l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.attack("a YAML alias bomb (billion laughs) in a config value")
def test_a_yaml_alias_bomb_is_refused_in_milliseconds():
    start = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        parse_yaml_text(alias_bomb(), "bomb.yml")
    assert time.perf_counter() - start < 1.0
    assert f"bomb.yml: YAML value refused at line 8, column 7: its aliases (*name) expand to more than " \
           f"{MAX_EXPANDED_NODES:,} values" in str(caught.value)


def test_aliases_a_config_really_uses_still_load():
    text = "common: &c {lr: 0.001, betas: [0.9, 0.95]}\noptimizer: {type: Adam, params: *c}\nother: [*c, *c]\n"
    values = parse_yaml_text(text, "ok.yml")
    assert values["optimizer"]["params"] == values["common"] == {"lr": 0.001, "betas": [0.9, 0.95]}
    parse_yaml_text(alias_bomb(levels=5), "small.yml")  # 9**5 = 59,049 values: large, but under the bound


@pytest.mark.attack("a YAML alias that refers to the value containing it (an infinite value)")
def test_a_recursive_yaml_alias_is_refused():
    with pytest.raises(ConfigError, match=r"rec.yml: YAML value refused at line 1, column 4: an alias \(\*name\) "
                                          r"refers to the value that contains it"):
        parse_yaml_text("x: &a [1, *a]\n", "rec.yml")


@pytest.mark.attack("a YAML config nested 20,000 levels deep")
def test_a_deeply_nested_yaml_config_is_refused_by_name():
    with pytest.raises(ConfigError, match=f"deep.yml: YAML value refused at line 1, column 103: values nested more "
                                          f"than {MAX_DEPTH} levels deep"):
        parse_yaml_text("x: " + "[" * 20_000 + "]" * 20_000, "deep.yml")
    depth = MAX_DEPTH - 1  # the document mapping is the first level
    assert parse_yaml_text("x: " + "[" * depth + "]" * depth, "ok.yml")  # the bound itself still reads


@pytest.mark.attack("a JSON file nested 200,000 levels deep")
def test_a_deeply_nested_json_file_is_refused_by_name(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ConfigError, match=f"{path} is nested deeper than the reader can follow"):
        read_json(str(path), lambda message: ConfigError([message]))
    with pytest.raises(ValueError, match=r"x.json is not JSON: Expecting value at line 2, column 1"):
        parse_json("[1,\n]", "x.json")


@pytest.mark.attack("a text file that is not UTF-8 (Latin-1)")
def test_a_file_that_is_not_utf8_is_named_with_the_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError) as caught:
        read_utf8(str(path))
    assert str(caught.value).startswith(f"{path} is not UTF-8 text: the byte (0xe9) at byte offset 14, line 2 "
                                        f"does not decode; save it as UTF-8")
    assert decode_utf8("caf\u00e9".encode("utf-8"), "x") == "caf\u00e9"


@pytest.mark.attack("a JSONL data file (plain and gzip) with a byte that is not UTF-8")
def test_a_jsonl_document_that_is_not_utf8_names_file_offset_and_line(tmp_path):
    import gzip

    lines = b'{"text": "fine"}\n{"text": "caf\xe9"}\n'
    plain, packed, text = tmp_path / "docs.jsonl", tmp_path / "docs.jsonl.gz", tmp_path / "doc.txt"
    plain.write_bytes(lines)
    packed.write_bytes(gzip.compress(lines))
    text.write_bytes(b"ok\n\xff")
    for path in (plain, packed):
        with pytest.raises(DataError, match=f"{path} is not UTF-8 text: the byte \\(0xe9\\) at byte offset 30, line 2 "
                                            f"does not decode"):
            list(iter_json_records([str(path)]))
    with pytest.raises(DataError, match=f"{text} is not UTF-8 text: the byte \\(0xff\\) at byte offset 3, line 2"):
        list(iter_documents([str(text)]))
    plain.write_bytes(b'{"text": "fine"}\n' + b"[" * 100_000 + b"\n")
    with pytest.raises(DataError, match=f"{plain}:2: this line is nested deeper than the reader can follow"):
        list(iter_json_records([str(plain)]))
