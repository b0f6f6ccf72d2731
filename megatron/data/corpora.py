"""Corpora that tools/datasets/prepare_data.py knows by name: the offline `stdlib` corpus and the
online corpora GPT-NeoX users know (by URL; without network they fail with a message saying how to
download them by hand and pass the file with --input)."""

from __future__ import annotations

import os
import shutil
import sysconfig
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron.errors import DataError

EXCLUDED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class OnlineCorpus:
    name: str
    url: str
    note: str = ""


ONLINE_CORPORA: dict[str, OnlineCorpus] = {
    c.name: c
    for c in (
        OnlineCorpus("enwik8", "https://data.deepai.org/enwik8.zip", "also at http://mattmahoney.net/dc/enwik8.zip"),
        OnlineCorpus("enron", "http://eaidata.bmk.sh/data/enron_emails.jsonl.zst"),
        OnlineCorpus("pile_subset", "https://the-eye.eu/public/AI/pile/train/00.jsonl.zst"),
        OnlineCorpus("github", "http://eaidata.bmk.sh/data/github_small.jsonl.zst"),
        OnlineCorpus(
            "europarl",
            "https://the-eye.eu/public/AI/pile_preliminary_components/EuroParliamentProceedings_1996_2011.jsonl.zst",
        ),
        OnlineCorpus("freelaw", "https://the-eye.eu/public/AI/pile_preliminary_components/FreeLaw_Opinions.jsonl.zst"),
        OnlineCorpus(
            "nih",
            "https://the-eye.eu/public/AI/pile_preliminary_components/NIH_ExPORTER_awarded_grant_text.jsonl.zst",
        ),
        OnlineCorpus(
            "ubuntu_irc",
            "https://the-eye.eu/public/AI/pile_preliminary_components/ubuntu_irc_until_2020_9_1.jsonl.zst",
        ),
        OnlineCorpus("youtube_subtitles", "https://the-eye.eu/public/AI/pile_preliminary_components/yt_subs.jsonl.zst"),
        OnlineCorpus(
            "c4", "https://huggingface.co/datasets/allenai/c4/resolve/main/en/c4-train.00000-of-01024.json.gz"
        ),
    )
}
OFFLINE_CORPORA = ("stdlib",)


def stdlib_source_files(root: str | None = None) -> list[Path]:
    """The standard library's .py files (no site-packages, tests or caches), sorted by relative path."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_STDLIB_DIRS)
        for f in filenames:
            if f.endswith(".py") and not f.startswith("_sysconfigdata"):
                files.append(Path(dirpath) / f)
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def iter_stdlib_texts(root: str | None = None) -> Iterator[str]:
    """The text of each stdlib source file in order; files that are not UTF-8 are skipped."""
    for path in stdlib_source_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield text


def download(corpus: OnlineCorpus, directory: Path, timeout: float = 30.0) -> Path:
    """Fetch the corpus file into `directory` (reused when present); offline it raises one clear DataError."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / corpus.url.rsplit("/", 1)[-1]
    if target.is_file():
        return target
    tmp = target.with_suffix(target.suffix + ".part")
    try:
        with urllib.request.urlopen(corpus.url, timeout=timeout) as resp, open(tmp, "wb") as fh:
            shutil.copyfileobj(resp, fh, 1 << 20)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        tmp.unlink(missing_ok=True)
        extra = f" ({corpus.note})" if corpus.note else ""
        raise DataError(
            f"cannot download corpus '{corpus.name}' from {corpus.url}{extra}: {exc}. "
            f"Without network access, download it by hand and pass the file with "
            f"`--input PATH` (e.g. prepare_data.py {corpus.name} --input ~/Downloads/{target.name})."
        ) from exc
    tmp.rename(target)
    return target


def unpack_if_archive(path: Path, directory: Path) -> list[Path]:
    """Zip archives are extracted (their members become plain-text inputs); others are returned as they are."""
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if not n.endswith("/")]
            zf.extractall(directory)
        return [directory / n for n in sorted(names)]
    if path.name.endswith((".tar", ".tar.gz", ".tgz")):
        raise DataError(
            f"'{path}' is a tar archive; extract it by hand and pass its .jsonl/.jsonl.zst files with --input."
        )
    return [path]
