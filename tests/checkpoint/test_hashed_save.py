"""megatron.checkpoint.hashed_save: the file torch.load reads, written past the page cache (O_DIRECT) from the tensors' own
memory where they are aligned, its XXH3-128 computed from the bytes as they were written, torch's CRC32 skipped for
this file only (the process-wide setting, which the training thread's torch.save uses, is never changed); where
the file system refuses O_DIRECT, the same file the ordinary way."""
import errno
import os
import zipfile

import pytest
import torch

from megatron.checkpoint import hashed_save
from megatron.checkpoint.async_save import ArenaPool, snapshot
from megatron.checkpoint.hashed_save import BLOCK, DirectFile, new_digest, save_hashed


def xxh128(data: bytes) -> str:
    digest = new_digest()
    digest.update(data)
    return digest.hexdigest()


def direct_io_works(directory) -> bool:
    """Whether ``directory``'s file system takes an aligned O_DIRECT write (found out here, not by the writer)."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return False
    block = mmap.mmap(-1, BLOCK)
    try:
        handle = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o666)
        try:
            return os.write(handle, block) == BLOCK
        finally:
            os.close(handle)
    except OSError:
        return False


def a_state():
    state = {"w": torch.randn(300, 70), "tied": [torch.arange(7)], "step": 3, "bf16": torch.randn(5).bfloat16(),
             "big": torch.randn(3 * BLOCK + 5)}  # a record that ends in a partial block
    state["again"] = state["w"]
    return state


def check_file(path, digest, state):
    data = path.read_bytes()
    assert digest == xxh128(data)
    loaded = torch.load(path, weights_only=True)
    assert loaded["again"] is loaded["w"] and loaded["step"] == 3
    for key in ("w", "bf16", "big"):
        assert torch.equal(loaded[key], state[key]) and loaded[key].dtype == state[key].dtype
    assert torch.equal(loaded["tied"][0], state["tied"][0])
    return data


def test_the_digest_is_of_the_bytes_on_disk_and_the_file_loads_without_a_crc32(tmp_path, monkeypatch):
    settings_seen = []
    write = DirectFile.write

    def watched(self, data):  # what a torch.save on another thread would see at every moment of this save
        settings_seen.append(torch.serialization.get_crc32_options())
        return write(self, data)

    monkeypatch.setattr(DirectFile, "write", watched)
    state = a_state()
    path = tmp_path / "a.pt"
    check_file(path, save_hashed(state, str(path)), state)
    assert hashed_save.SKIPS_CRC32  # the torch this project pins: the internals it calls are there
    assert zipfile.ZipFile(path).testzip() is not None  # no CRC32 computed for its records...
    assert len(settings_seen) > 3 and all(settings_seen)  # ...while the process-wide setting stayed on throughout
    torch.save(state, tmp_path / "b.pt")
    assert zipfile.ZipFile(tmp_path / "b.pt").testzip() is None  # torch.save elsewhere keeps its CRC32


def refuse_o_direct(monkeypatch) -> None:
    """os.open as on a file system without O_DIRECT."""
    real_open = os.open

    def no_direct_open(path, flags, *rest):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *rest)

    monkeypatch.setattr(os, "open", no_direct_open)


@pytest.mark.parametrize("file_system", ["as it is", "without O_DIRECT"])
def test_aligned_tensors_go_to_the_disk_from_their_own_memory_and_paced(tmp_path, monkeypatch, file_system):
    state = a_state()
    copied, _ = snapshot(state, ArenaPool())  # page-aligned copies, as async_save's writer gets them
    if file_system == "without O_DIRECT":
        refuse_o_direct(monkeypatch)
    direct = direct_io_works(tmp_path)
    writes = []
    real_write = os.write

    def recording(fd, data):
        writes.append((len(data), hashed_save._address(memoryview(data))))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", recording)
    paced = []
    path = tmp_path / "a.pt"
    file_digest = save_hashed(copied, str(path), pace=paced.append)
    data = check_file(path, file_digest, state)
    assert any(address == copied["w"].data_ptr() for _, address in writes)  # large pieces from their own memory
    big = copied["big"]
    nbytes = big.numel() * big.element_size()
    if direct:
        assert (nbytes // BLOCK * BLOCK, big.data_ptr()) in writes  # its whole blocks from the tensor, the rest staged
        assert all(length % BLOCK == 0 and address % BLOCK == 0 for length, address in writes)  # O_DIRECT's rules
        assert sum(paced) == sum(length for length, _ in writes) >= len(data)  # the last block padded, then cut
    else:  # a file system without O_DIRECT: the ordinary way, whole pieces, nothing padded
        assert (nbytes, big.data_ptr()) in writes
        assert sum(paced) == sum(length for length, _ in writes) == len(data)


def test_a_file_system_without_o_direct_gets_the_same_file(tmp_path, monkeypatch):
    state = a_state()
    copied, _ = snapshot(state, ArenaPool())
    direct_path = tmp_path / "direct.pt"
    expected = check_file(direct_path, save_hashed(copied, str(direct_path)), state)
    with monkeypatch.context() as refused_here:
        refuse_o_direct(refused_here)
        path = tmp_path / "plain.pt"
        assert check_file(path, save_hashed(copied, str(path)), state) == expected

    real_write, refused = os.write, []

    def refusing_write(fd, data):  # opened with O_DIRECT, but the write is refused
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refusing_write)
    path = tmp_path / "refused.pt"
    assert check_file(path, save_hashed(copied, str(path)), state) == expected and refused


class Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle this")


@pytest.mark.parametrize("failure", ["pickling", "disk full", "fsync fails"])
def test_a_failed_save_raises_its_error_and_closes_the_file(tmp_path, monkeypatch, failure):
    """torch's zip writer ends the file when it is destroyed and aborts the process if that fails: ended here."""
    state = {f"t{i}": torch.randn(100000) for i in range(8)}  # 3.2 MB: several writes
    expected = TypeError if failure == "pickling" else OSError
    if failure == "pickling":
        state["bad"] = Unpicklable()
    elif failure == "disk full":
        real_write, calls = os.write, []

        def filling(fd, data):
            calls.append(len(data))
            if len(calls) > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", filling)
    else:
        def failing_fsync(fd):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "fsync", failing_fsync)
    open_files = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with pytest.raises(expected):
        save_hashed(state, str(tmp_path / "a.pt"))
    if open_files is not None:
        assert len(os.listdir("/proc/self/fd")) == open_files


def test_without_torchs_internals_it_falls_back_to_torch_save(tmp_path, monkeypatch):
    monkeypatch.setattr(hashed_save, "SKIPS_CRC32", False)
    path = tmp_path / "a.pt"
    assert save_hashed({"w": torch.ones(3)}, str(path)) == xxh128(path.read_bytes())
    assert zipfile.ZipFile(path).testzip() is None and torch.equal(torch.load(path)["w"], torch.ones(3))
