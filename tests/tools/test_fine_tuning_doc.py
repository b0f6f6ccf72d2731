"""docs/fine-tuning.md's worked example runs as written: a tiny Llama 3.2-style model made with transformers is
converted in at tensor parallel 2, fine-tuned through deepy.py (with --set), exported, and deepy.py generate.py at
tensor parallel 2 gives transformers' greedy tokens of the export (the example's last block asserts it)."""
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


@pytest.mark.slow
def test_the_worked_example_runs_and_the_export_decodes_like_our_generate(tmp_path):
    blocks = worked_example_blocks()
    assert len(blocks) == 3
    for name in ("deepy.py", "train.py", "generate.py", "tools", "megatron"):  # "from the repository root"
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    result = subprocess.run(["bash", "-e", "-c", "\n".join(blocks)], cwd=tmp_path, env=deepy_environment(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + "\n" + result.stderr[-6000:]
    assert result.stdout.count("| transformers:") == 3, result.stdout[-3000:]
    overrides = tmp_path / "checkpoints" / "tiny-llama-finetuned" / "global_step60" / "configs"
    assert "train_iters: 60" in (overrides / "command_line_overrides.yml").read_text()


@pytest.mark.slow
def test_the_lora_example_trains_merges_and_exports_for_peft(tmp_path):
    """Step 1 of the worked example (the converted tiny Llama), then the LoRA example's blocks: adapters trained at
    tensor parallel 2 through deepy.py, generated with as they are, merged, exported for peft; peft on the converted
    base and generate.py decode as the merged model (the last block asserts it)."""
    blocks = worked_example_blocks()[:1] + worked_example_blocks(LORA_SECTION)
    assert len(blocks) == 3
    for name in ("deepy.py", "train.py", "generate.py", "tools", "megatron"):  # "from the repository root"
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    result = subprocess.run(["bash", "-e", "-c", "\n".join(blocks)], cwd=tmp_path, env=deepy_environment(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + "\n" + result.stderr[-6000:]
    assert result.stdout.count("| peft: same tokens") == 3, result.stdout[-3000:]
    adapters = tmp_path / "checkpoints" / "tiny-llama-lora" / "global_step40"
    assert (adapters / "COMPLETE").is_file() and (tmp_path / "tiny-llama-adapter" / "adapter_config.json").is_file()
