"""Checkpoint integrity: checksums written at save and verified before load, damaged files named, a full disk
during a save reported as such with `latest` untouched, and the space for a checkpoint checked up front."""

import hashlib
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from megatron.checkpoint.integrity import LEGACY_MANIFEST, MANIFEST, read_manifest, verification_problems, write_manifest
from megatron.checkpoint.hashed_save import new_digest
from megatron.checkpoint.engine import estimated_checkpoint_bytes, space_problem
from megatron.checkpoint.format import read_latest, tag_for
from megatron.errors import CheckpointError
from tests.checkpoint.test_engine import FakeEngine, args_for, load, resolve, save
from tests.immutable_dirs import immutable  # noqa: F401 (a fixture)


pytestmark = pytest.mark.fault


@pytest.fixture
def two_checkpoints(tmp_path):
    args = args_for(tmp_path)
    for iteration in (4, 8):
        save(args, iteration, FakeEngine())
    return args, tmp_path / tag_for(8)


def test_the_manifest_lists_every_file_with_its_xxh128(two_checkpoints):
    _, path = two_checkpoints
    digests = read_manifest(str(path))
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()
                     and p.name not in ("COMPLETE", MANIFEST))
    assert sorted(digests) == on_disk and "mp_rank_00_model_states.pt" in digests and "neox_args.json" in digests
    expected = new_digest()
    expected.update((path / "neox_args.json").read_bytes())
    assert digests["neox_args.json"] == expected.hexdigest()
    assert verification_problems(str(path)) == []
    if shutil.which("xxh128sum"):  # the standard tool reads it too (Debian's package xxhash)
        subprocess.run(["xxh128sum", "--quiet", "-c", MANIFEST], cwd=path, check=True)


def test_a_checkpoint_with_the_older_sha256_manifest_is_verified_with_it(two_checkpoints):
    """Checkpoints saved before XXH3-128 carry checksums.sha256 (sha256sum's format)."""
    args, path = two_checkpoints
    files = sorted(read_manifest(str(path)))
    (path / LEGACY_MANIFEST).write_text("".join(f"{hashlib.sha256((path / name).read_bytes()).hexdigest()}  {name}\n"
                                                for name in files))
    os.remove(path / MANIFEST)
    assert sorted(read_manifest(str(path))) == files and verification_problems(str(path)) == []
    assert load(args, FakeEngine()) is not None
    _flip_middle_byte(path / "mp_rank_00_model_states.pt")
    assert verification_problems(str(path)) == [
        "mp_rank_00_model_states.pt is damaged (its SHA-256 differs from the one recorded when it was saved)"]
    save(args, 8, FakeEngine())  # saved again: one manifest, the current kind
    assert (path / MANIFEST).is_file() and not (path / LEGACY_MANIFEST).exists()
    assert verification_problems(str(path)) == []


def _flip_middle_byte(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x55
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["middle", "first-bytes", "truncated-rng", "missing-model", "neox-args"])
@pytest.mark.attack("a checkpoint file damaged, truncated or deleted after its save, to be loaded silently")
def test_a_damaged_file_is_named_and_nothing_is_loaded(two_checkpoints, damage):
    args, path = two_checkpoints
    if damage == "middle":  # still a readable file: it loaded silently before checksums
        file = path / "mp_rank_00_model_states.pt"
        _flip_middle_byte(file)
    elif damage == "first-bytes":
        file = path / "mp_rank_00_model_states.pt"
        file.write_bytes(b"\x00garbage" + file.read_bytes()[8:])
    elif damage == "truncated-rng":
        file = path / "rng_state_rank0.pt"
        file.write_bytes(file.read_bytes()[:100])
    elif damage == "missing-model":
        file = path / "mp_rank_00_model_states.pt"
        file.unlink()
    else:
        file = path / "neox_args.json"
        file.write_text("{not json")
    engine = FakeEngine()
    with pytest.raises(CheckpointError) as caught:
        load(args, engine)
    message = str(caught.value)
    assert f"checkpoint {path} is damaged: {file.name} is " + ("missing" if damage == "missing-model" else "damaged") \
        in message
    assert "Other complete checkpoints: ['global_step4'] — set iteration to one of them" in message
    assert engine.loaded == []
    assert resolve(args_for(path.parent, iteration=4)) == (str(path.parent), "global_step4")


def test_a_checkpoint_without_checksums_still_gets_clean_errors(two_checkpoints):
    """GPT-NeoX's checkpoints and this project's older ones have no manifest: a damaged neox_args.json or RNG
    file is still named instead of a traceback."""
    args, path = two_checkpoints
    os.remove(path / MANIFEST)
    (path / "neox_args.json").write_bytes(b"\x00\xff garbage")
    with pytest.raises(CheckpointError, match=r"neox_args.json is damaged \(not JSON"):
        resolve(args)
    save(args, 8, FakeEngine())
    rng = path / "rng_state_rank0.pt"
    rng.write_bytes(rng.read_bytes()[:50])
    write_manifest(str(path))  # checksums that agree with the damage (a current-layout checkpoint needs them)
    with pytest.raises(CheckpointError, match="cannot read .*rng_state_rank0.pt"):
        load(args, FakeEngine())


@pytest.fixture
def small_filesystem(tmp_path):
    """A 2 MiB tmpfs (root only; CI runs as root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", f"tmpfs_{uuid.uuid4().hex[:8]}", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


class BigEngine(FakeEngine):
    """Writes `size` bytes of weights, as a model of that size would."""

    def __init__(self, size):
        super().__init__()
        self.size = size

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        torch.save({"module": {"w": torch.ones(self.size // 4)}, **client_state},
                   os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))


def test_a_full_disk_during_a_save_is_named_and_latest_stays(small_filesystem):
    args = args_for(small_filesystem)
    save(args, 4, BigEngine(512 * 1024))
    with pytest.raises(CheckpointError) as caught:
        save(args, 8, BigEngine(4 * 1024 * 1024))
    message = str(caught.value)
    assert f"saving checkpoint {small_filesystem / 'global_step8'} failed: the disk is full" in message
    assert "'latest' still names global_step4, which is complete and will be resumed from" in message
    assert read_latest(str(small_filesystem)) == "global_step4"
    assert not (small_filesystem / "global_step8").exists()  # the partial one is gone, and its space with it
    assert resolve(args) == (str(small_filesystem), "global_step4")


def test_the_space_for_one_checkpoint_is_checked(small_filesystem):
    parameters = 1_000_000  # fp32 weights + Adam: 12 MB, on a 2 MiB filesystem
    needed = estimated_checkpoint_bytes(str(small_filesystem), parameters, weight_bytes=4)
    assert needed == 12_000_000
    assert estimated_checkpoint_bytes(str(small_filesystem), parameters, weight_bytes=2) == 14_000_000
    problem = space_problem(str(small_filesystem), needed)
    assert problem.startswith(f"save='{small_filesystem}' has ") and "one checkpoint of this run takes about " \
        "0.01 GiB" in problem
    args = args_for(small_filesystem)
    save(args, 4, BigEngine(256 * 1024))  # with a checkpoint there, its size is the estimate
    size = sum(p.stat().st_size for p in (small_filesystem / "global_step4").rglob("*") if p.is_file())
    assert estimated_checkpoint_bytes(str(small_filesystem), parameters, weight_bytes=4) == size
    assert space_problem(str(small_filesystem), size) is None


@pytest.mark.attack("a checkpoint of the current layout with its checksum manifest deleted and its weights "
                    "overwritten, to be loaded unverified as if it were GPT-NeoX's")
def test_a_current_checkpoint_without_its_manifest_is_refused_naming_it(two_checkpoints):
    from megatron.checkpoint.neox_checkpoint import resolve_checkpoint_dir
    from megatron.errors import ConversionError

    args, path = two_checkpoints
    os.remove(path / MANIFEST)
    _flip_middle_byte(path / "mp_rank_00_model_states.pt")
    engine = FakeEngine()
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is damaged: its {MANIFEST} is missing, though it "
                                              rf"is a checkpoint of this project's current layout"):
        load(args, engine)
    assert engine.loaded == []
    with pytest.raises(ConversionError, match=f"its {MANIFEST} is missing"):
        resolve_checkpoint_dir(str(path))  # conversion, generation and evaluation read it here
    os.remove(path / "neox_args.json")  # the layout record gone too: still this project's (COMPLETE)
    assert f"{MANIFEST} is missing" in "".join(verification_problems(str(path)))


class DeepSpeedLikeEngine(FakeEngine):
    """Creates the checkpoint's directory as DeepSpeed's engine does (_create_checkpoint_file): a failure is logged
    and swallowed, and torch.save then says "Parent directory ... does not exist"."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        try:
            os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        except OSError:
            pass
        torch.save({"module": {}, **client_state}, os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))


@pytest.mark.attack("an immutable save directory (chattr +i): named as a permission problem, not a missing parent "
                    "directory or free space")
def test_an_immutable_save_directory_is_named_as_a_permission_problem(tmp_path, immutable):
    args = args_for(tmp_path)
    save(args, 4, FakeEngine())
    immutable(tmp_path)
    with pytest.raises(CheckpointError) as caught:
        save(args, 8, DeepSpeedLikeEngine())
    message = str(caught.value)
    assert f"saving checkpoint {tmp_path / 'global_step8'} failed: '{tmp_path}' cannot be written (Operation not " \
           f"permitted): a permission problem" in message, message
    assert "Parent directory" not in message and "GiB free" not in message, message
    assert "chattr -i" in message and "'latest' still names global_step4" in message
    assert read_latest(str(tmp_path)) == "global_step4"


@pytest.mark.attack("a checkpoint's neox_args.json nested 200,000 levels deep")
def test_a_deeply_nested_neox_args_json_is_named_as_damaged(two_checkpoints):
    args, path = two_checkpoints
    os.remove(path / MANIFEST)
    (path / "neox_args.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match=r"neox_args.json is damaged \(nested thousands of levels deep"):
        resolve(args)
