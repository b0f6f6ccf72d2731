"""docs/fine-tuning.md's worked examples run as written. The first: a tiny Llama 3.2-style model made with
transformers is converted in at tensor parallel 2, fine-tuned through deepy.py (with --set), exported, and deepy.py
generate.py at tensor parallel 2 gives transformers' greedy tokens of the export. The LoRA one: adapters trained on a
chat JSONL (loss on the assistant's tokens) from the same converted model, merged, converted and exported for peft;
transformers on the merged model and peft on the base give generate.py's greedy tokens (each last block asserts it)."""
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.launch import REPO, deepy_environment

DOC = Path(REPO) / "docs" / "fine-tuning.md"
SECTION = "## Worked example"


LORA_SECTION = "### Worked example: LoRA"


def worked_example_blocks(heading: str = SECTION) -> list:
    """The ```bash blocks of the worked example's section (``heading``), in order."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    following = section.find("\n## ", len(heading))
    section = section if following < 0 else section[:following]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def run_from_a_repository_root(blocks: list, folder: Path) -> subprocess.CompletedProcess:
    """The blocks as one `bash -e` script in ``folder``, made to look like the repository root the page runs them
    from (its scripts and packages linked in); fails the test, with the output's tails, if the script fails."""
    for name in ("deepy.py", "train.py", "generate.py", "tools", "megatron"):
        os.symlink(os.path.join(REPO, name), folder / name)
    result = subprocess.run(["bash", "-e", "-c", "\n".join(blocks)], cwd=folder, env=deepy_environment(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + "\n" + result.stderr[-6000:]
    return result


@pytest.mark.slow
def test_the_worked_example_runs_and_the_export_decodes_like_our_generate(tmp_path):
    blocks = worked_example_blocks()
    assert len(blocks) == 3
    result = run_from_a_repository_root(blocks, tmp_path)
    assert result.stdout.count("| transformers:") == 3, result.stdout[-3000:]
    overrides = tmp_path / "checkpoints" / "tiny-llama-finetuned" / "global_step60" / "configs"
    assert "train_iters: 60" in (overrides / "command_line_overrides.yml").read_text()


@pytest.mark.slow
def test_the_lora_example_trains_on_chat_merges_and_exports_for_peft(tmp_path):
    """Step 1 of the worked example (the converted tiny Llama, its tokenizer with a chat template), then the LoRA
    example's blocks: chat data with assistant-only labels, adapters trained at tensor parallel 2 through deepy.py,
    merged, converted, exported for peft; the last block checks the loss fell and the three decodings agree."""
    blocks = worked_example_blocks()[:1] + worked_example_blocks(LORA_SECTION)
    assert len(blocks) == 3
    result = run_from_a_repository_root(blocks, tmp_path)
    assert "LoRA training loss every 10 steps:" in result.stdout, result.stdout[-3000:]
    assert result.stdout.count("| transformers and peft: same tokens") == 3, result.stdout[-3000:]
    adapters = tmp_path / "checkpoints" / "tiny-llama-lora" / "global_step40"
    assert (adapters / "COMPLETE").is_file() and (tmp_path / "tiny-llama-adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "data" / "chat_messages_label_document.idx").is_file()
