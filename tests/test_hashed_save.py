"""megatron.hashed_save: the file torch.load reads, its SHA-256 computed from the bytes as they were written, torch's
CRC32 skipped for this file only (the process-wide setting, which the training thread's torch.save uses, is never
changed)."""
import hashlib
import zipfile

import torch

from megatron import hashed_save
from megatron.hashed_save import HashingFile, save_hashed


def test_the_digest_is_of_the_bytes_on_disk_and_the_file_loads_without_a_crc32(tmp_path, monkeypatch):
    settings_seen = []
    write = HashingFile.write

    def watched(self, data):  # what a torch.save on another thread would see at every moment of this save
        settings_seen.append(torch.serialization.get_crc32_options())
        return write(self, data)

    monkeypatch.setattr(HashingFile, "write", watched)
    state = {"w": torch.randn(300, 70), "tied": [torch.arange(7)], "step": 3}
    state["again"] = state["w"]
    path = tmp_path / "a.pt"
    digest = save_hashed(state, str(path))
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["again"] is loaded["w"] and loaded["step"] == 3
    assert hashed_save.SKIPS_CRC32  # the torch this project pins: the internals it calls are there
    assert zipfile.ZipFile(path).testzip() is not None  # no CRC32 computed for its records...
    assert len(settings_seen) > 3 and all(settings_seen)  # ...while the process-wide setting stayed on throughout
    torch.save(state, tmp_path / "b.pt")
    assert zipfile.ZipFile(tmp_path / "b.pt").testzip() is None  # torch.save elsewhere keeps its CRC32


def test_without_torchs_internals_it_falls_back_to_torch_save(tmp_path, monkeypatch):
    monkeypatch.setattr(hashed_save, "SKIPS_CRC32", False)
    path = tmp_path / "a.pt"
    assert save_hashed({"w": torch.ones(3)}, str(path)) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert zipfile.ZipFile(path).testzip() is None and torch.equal(torch.load(path)["w"], torch.ones(3))
