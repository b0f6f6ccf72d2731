"""The documentation's shape: README short with links that resolve, every code block tagged with its language (so no
command escapes tests/docs/test_commands.py), and the GPT-NeoX page naming every key the validation refuses."""
import dataclasses
import re

from tests.docs.extract import REPO, untagged_blocks

README_MAX_LINES = 250
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_short_and_its_links_resolve():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES, "README.md: move the detail into docs/"
    missing = [target for target in LINK.findall(readme) if "://" not in target and not (REPO / target).exists()]
    assert not missing, missing


def test_every_code_block_names_its_language():
    assert not untagged_blocks(), ("tag these blocks (bash, text, yaml, ...): a shell command in an untagged block "
                                   "would escape tests/docs/test_commands.py", untagged_blocks())


def test_the_gpt_neox_page_names_every_refused_key():
    from megatron.neox_arguments.validation import NOT_SUPPORTED_SETTINGS, NOT_SUPPORTED_YET

    page = (REPO / "docs" / "coming-from-gpt-neox.md").read_text(encoding="utf-8")
    refused = page[page.index("## What is refused, and why"):]
    keys = {key for key, _, _ in NOT_SUPPORTED_YET} | {key for _, keys in NOT_SUPPORTED_SETTINGS for key in keys}
    unnamed = sorted(key for key in keys if f"`{key}" not in refused and not
                     (key.startswith("te_fp8_") and "`te_fp8_*`" in refused))
    assert not unnamed, f"docs/coming-from-gpt-neox.md, 'What is refused, and why': add {unnamed}"


def test_the_gpt_neox_page_lists_only_keys_that_are_refused():
    """The other way round: a key in the table's first column that validation no longer refuses (a feature built
    since) must leave the table."""
    from megatron.neox_arguments.validation import NOT_SUPPORTED_SETTINGS, NOT_SUPPORTED_YET

    page = (REPO / "docs" / "coming-from-gpt-neox.md").read_text(encoding="utf-8")
    table = page[page.index("## What is refused, and why"):].split("\n\n", 3)[2]
    listed = {word.split(":")[0] for row in table.splitlines()[2:] for word in re.findall(r"`([^`]+)`", row.split("|")[1])}
    refused = {key for key, _, _ in NOT_SUPPORTED_YET} | {key for _, keys in NOT_SUPPORTED_SETTINGS for key in keys}
    refused |= {"non_persistent_ckpt_type"}  # refused by value (validation.non_persistent_problems)
    from megatron.neox_arguments import NeoXArgs

    keys = {field.name for field in dataclasses.fields(NeoXArgs)}
    stale = sorted(key for key in listed & keys if key not in refused)
    assert not stale, f"docs/coming-from-gpt-neox.md lists {stale} as refused, but validation accepts them"
