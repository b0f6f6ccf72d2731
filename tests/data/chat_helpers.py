"""A tiny Hugging Face tokenizer folder with a Jinja chat template, made offline for chat-data tests."""

from __future__ import annotations

from pathlib import Path

from tests.tokenizer.tokenizer_files import make_hf_tokenizer_files

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def hf_folder(directory: Path, template: str | None = TEMPLATE) -> Path:
    """directory/hf: tokenizer.json (a byte-level BPE trained here), tokenizer_config.json with `template`."""
    from transformers import PreTrainedTokenizerFast

    files = make_hf_tokenizer_files(directory)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(files["tokenizer_json"]), eos_token="<|endoftext|>")
    if template:
        tok.chat_template = template
    tok.save_pretrained(directory / "hf")
    return directory / "hf"
