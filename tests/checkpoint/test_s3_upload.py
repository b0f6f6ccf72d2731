"""s3_path (megatron.checkpoint.s3_upload) against a real S3 server on 127.0.0.1 (tests/checkpoint/s3_server.py):
complete checkpoints only, in chunks, byte-identical, COMPLETE last; an interrupted upload is never taken for a
complete one and is finished by the next sync; failures name the bucket and key. The run through deepy.py:
tests/e2e/test_train.py (test_deepspeed_scheduler_dict_sets_the_lr_and_resumes_exactly)."""

import os
import re

import pytest
import torch

from megatron.checkpoint.integrity import checkpoint_files
from megatron.checkpoint.s3_location import S3Location, s3_problems
from megatron.checkpoint.s3_upload import (S3Uploads, bucket_problem, pending_checkpoints, remote_complete, s3_client,
                                           upload_checkpoint)
from megatron.errors import CheckpointError
from tests.checkpoint.s3_server import remote_files, s3_server
from tests.checkpoint.test_engine import FakeEngine, args_for, save

CHUNK = 1024


@pytest.fixture(scope="module")
def server():
    with s3_server(smallest_part=CHUNK) as environment:
        yield environment


@pytest.fixture
def client(server, monkeypatch, request):
    for name, value in server.items():
        monkeypatch.setenv(name, value)
    client = s3_client()
    client.create_bucket(Bucket="ckpts")
    yield client
    for item in client.list_objects_v2(Bucket="ckpts").get("Contents", []):
        client.delete_object(Bucket="ckpts", Key=item["Key"])
    for upload in client.list_multipart_uploads(Bucket="ckpts").get("Uploads", []):
        client.abort_multipart_upload(Bucket="ckpts", Key=upload["Key"], UploadId=upload["UploadId"])


def _checkpoint(tmp_path, iteration: int, seed: int = 0) -> str:
    """A complete checkpoint whose model-states file spans several CHUNKs."""
    torch.manual_seed(seed)
    return save(args_for(tmp_path), iteration, FakeEngine(), {"blob": torch.randn(3000)})


def _all_files(path: str):
    return checkpoint_files(path) + ["checksums.xxh128", "COMPLETE"]


def assert_uploaded(client, path: str, prefix: str) -> None:
    tag = os.path.basename(path)
    remote = remote_files(client, "ckpts", f"{prefix}/{tag}")
    assert sorted(remote) == sorted(_all_files(path))
    for relative in _all_files(path):
        with open(os.path.join(path, relative), "rb") as handle:
            assert remote[relative] == handle.read(), relative


class _Recording:
    """The real client, recording which keys were written in which order; ``fail_after_parts``: the next part
    after that many raises (the network down), and abort does nothing (as when the process is killed)."""

    def __init__(self, client, fail_after_parts=None):
        self.client, self.fail_after_parts, self.written, self.parts = client, fail_after_parts, [], 0

    def __getattr__(self, name):
        return getattr(self.client, name)

    def put_object(self, **kwargs):
        self.written.append(kwargs["Key"])
        return self.client.put_object(**kwargs)

    def upload_part(self, **kwargs):
        if self.fail_after_parts is not None and self.parts >= self.fail_after_parts:
            raise ConnectionResetError("connection reset by peer")
        self.parts += 1
        return self.client.upload_part(**kwargs)

    def abort_multipart_upload(self, **kwargs):
        if self.fail_after_parts is None:
            return self.client.abort_multipart_upload(**kwargs)
        return None

    def complete_multipart_upload(self, **kwargs):
        self.written.append(kwargs["Key"])
        return self.client.complete_multipart_upload(**kwargs)


def test_a_complete_checkpoint_is_uploaded_in_chunks_byte_identical_with_complete_last(client, tmp_path):
    path = _checkpoint(tmp_path, 4)
    recording = _Recording(client)
    files, size = upload_checkpoint(recording, S3Location.parse("s3://ckpts/run1"), path, CHUNK)
    assert files == len(_all_files(path)) - 1 and size > 3 * CHUNK
    assert_uploaded(client, path, "run1")
    assert recording.written[-2:] == ["run1/global_step4/COMPLETE", "run1/latest"]
    assert client.get_object(Bucket="ckpts", Key="run1/latest")["Body"].read() == b"global_step4"
    head = client.head_object(Bucket="ckpts", Key="run1/global_step4/mp_rank_00_model_states.pt")
    parts = -(-head["ContentLength"] // CHUNK)
    assert parts >= 12 and head["ETag"].endswith(f'-{parts}"')  # a multipart upload of CHUNK-byte parts
    assert remote_complete(client, S3Location.parse("s3://ckpts/run1"), path)


def test_an_interrupted_upload_leaves_no_complete_and_the_next_sync_finishes_it(client, tmp_path, capsys):
    path = _checkpoint(tmp_path, 4)
    location = S3Location.parse("s3://ckpts/run1")
    failing = _Recording(client, fail_after_parts=3)
    with pytest.raises(CheckpointError) as caught:
        upload_checkpoint(failing, location, path, CHUNK)
    assert str(caught.value).startswith(
        f"uploading checkpoint {path} to s3://ckpts/run1/global_step4 failed at "
        f"s3://ckpts/run1/global_step4/mp_rank_00_model_states.pt: ConnectionResetError: connection reset by peer; "
        f"the local checkpoint is intact"), caught.value
    assert "global_step4/COMPLETE" not in remote_files(client, "ckpts", "run1")
    assert not remote_complete(client, location, path) and pending_checkpoints(client, location, str(tmp_path))
    assert client.list_multipart_uploads(Bucket="ckpts").get("Uploads")  # left open, as by a killed process
    uploads = S3Uploads(client, "s3://ckpts/run1", CHUNK, str(tmp_path))
    uploads.start()
    uploads.finish()
    assert_uploaded(client, path, "run1")
    assert not client.list_multipart_uploads(Bucket="ckpts").get("Uploads")
    assert "uploaded checkpoint" in capsys.readouterr().out
    assert pending_checkpoints(client, location, str(tmp_path)) == []


def test_a_partial_checkpoint_is_never_uploaded_and_a_changed_one_is_uploaded_again(client, tmp_path):
    first = _checkpoint(tmp_path, 2)
    os.makedirs(tmp_path / "global_step4")  # a save that died before COMPLETE
    (tmp_path / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    uploads = S3Uploads(client, "s3://ckpts/run1", CHUNK, str(tmp_path))
    uploads.start()
    uploads.finish()
    assert sorted({key.split("/")[0] for key in remote_files(client, "ckpts", "run1")}) == ["global_step2", "latest"]
    again = _checkpoint(tmp_path, 2, seed=1)  # the same iteration saved again (a run restarted from earlier)
    assert again == first and not remote_complete(client, S3Location.parse("s3://ckpts/run1"), again)
    uploads.start()
    uploads.finish()
    assert_uploaded(client, again, "run1")


def test_failures_name_the_bucket_the_key_and_the_credentials(client, tmp_path, monkeypatch, capsys):
    assert bucket_problem(client, S3Location.parse("s3://nobucket/x")) == (
        "s3_path: cannot reach bucket 'nobucket' (s3://nobucket/x): 404 Not Found: the bucket does not exist; create "
        "it or fix s3_path")
    path = _checkpoint(tmp_path, 4)
    uploads = S3Uploads(client, "s3://nobucket/run1", CHUNK, str(tmp_path))
    uploads.start()
    with pytest.raises(CheckpointError) as caught:
        uploads.finish()
    assert str(caught.value).startswith(
        f"uploading checkpoint {path} to s3://nobucket/run1/global_step4 failed at s3://nobucket/run1/global_step4/"
        f"COMPLETE: NoSuchBucket The specified bucket does not exist: the bucket does not exist; create it or fix "
        f"s3_path; the local checkpoint is intact"), caught.value
    assert capsys.readouterr().err == f"error: {caught.value}\n"
    assert os.path.isfile(os.path.join(path, "COMPLETE"))  # the local checkpoint untouched
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    problem = bucket_problem(s3_client(), S3Location.parse("s3://ckpts/run1"))
    assert problem.startswith("s3_path: cannot reach bucket 'ckpts' (s3://ckpts/run1): no usable AWS credentials") \
        and "AWS_ACCESS_KEY_ID" in problem, problem


def test_the_settings_are_checked():
    assert s3_problems(None, 100, None, chunk_set=False) == []
    assert s3_problems(None, 100, None, chunk_set=True) == [
        "s3_chunk_size=100 is a setting of s3_path; set s3_path or remove it"]
    assert s3_problems("ckpts/run1", 0, None, chunk_set=True) == [
        "s3_path='ckpts/run1' must be an S3 URL, s3://<bucket>[/<prefix>]",
        "s3_chunk_size=0 must be >= 1 byte (AWS S3 needs >= 5242880 = 5 MiB)",
        "s3_path='ckpts/run1' uploads the checkpoints written to save; set save"]
    assert S3Location.parse("s3://b/a/c/").key("global_step2", "COMPLETE") == "a/c/global_step2/COMPLETE"
    assert S3Location.parse("s3://b").key("latest") == "latest"


def test_a_config_with_s3_path_needs_boto3_before_anything_starts(monkeypatch):
    import megatron.utils.optional_deps as optional_deps
    from tests.neox_arguments.helpers import tiny

    monkeypatch.setattr(optional_deps, "installed", lambda package: package != "boto3")
    args = tiny(s3_path="s3://ckpts/run1", save="ckpt")
    assert optional_deps.missing_feature_packages(args, "train.py") == [
        "s3_path='s3://ckpts/run1' needs the Python package 'boto3', which is not installed: pip install -r "
        "requirements/requirements-s3.txt (or turn it off)"]
    assert optional_deps.missing_feature_packages(args, "generate.py") == []


def test_a_run_checks_the_bucket_before_its_first_step_and_finishes_an_earlier_upload_at_its_start(client, tmp_path):
    """megatron.training.loop's uploader: a bucket it cannot reach stops the run before the first step (on every
    rank); a checkpoint a killed run left without its upload is uploaded when the next run starts."""
    from megatron.training.loop import _s3_uploads

    path = _checkpoint(tmp_path, 4)
    with pytest.raises(CheckpointError, match=r"^s3_path: cannot reach bucket 'nobucket' \(s3://nobucket/run1\)"):
        _s3_uploads(args_for(tmp_path, s3_path="s3://nobucket/run1"), do_train=True)
    assert _s3_uploads(args_for(tmp_path, s3_path="s3://ckpts/run1"), do_train=False) is None
    uploads = _s3_uploads(args_for(tmp_path, s3_path="s3://ckpts/run1", s3_chunk_size=CHUNK), do_train=True)
    uploads.finish()
    assert_uploaded(client, path, "run1")


def test_a_chunk_size_the_server_or_s3_refuses_is_named(client, tmp_path, monkeypatch):
    import megatron.checkpoint.s3_upload as s3_upload

    path = _checkpoint(tmp_path, 4)
    location = S3Location.parse("s3://ckpts/run1")
    with pytest.raises(CheckpointError) as caught:  # parts below the server's smallest (here CHUNK bytes)
        upload_checkpoint(client, location, path, CHUNK - 24)
    assert re.search(r"failed at s3://ckpts/run1/global_step4/\S+: EntityTooSmall .*: s3_chunk_size is below the "
                     r"server's smallest part \(AWS S3: 5242880 bytes\); raise it", str(caught.value)), caught.value
    monkeypatch.setattr(s3_upload, "MAX_PARTS", 2)
    with pytest.raises(CheckpointError) as caught:
        upload_checkpoint(client, location, path, CHUNK)
    assert re.search(r"failed at s3://ckpts/run1/global_step4/\S+: ValueError: the file's \d+ bytes need \d+ parts of "
                     r"s3_chunk_size=1024 bytes, and S3 takes at most 2; raise s3_chunk_size", str(caught.value)), \
        caught.value
    assert "global_step4/COMPLETE" not in remote_files(client, "ckpts", "run1")


def test_async_save_starts_an_upload_when_a_persistent_checkpoint_completes_and_not_a_non_persistent_one(tmp_path):
    """With async_save the checkpoint completes on the writer's thread (megatron.training.loop's
    say_saved_in_background); the synchronous path is the deepy.py run of tests/e2e/test_train.py."""
    from types import SimpleNamespace

    from megatron.training.loop import _TrainingRun

    started = []
    args = args_for(tmp_path, non_persistent_ckpt_type="global")
    run = SimpleNamespace(save_started={}, neox_args=args, logger=SimpleNamespace(log_save=lambda *a, **k: None),
                          uploads=SimpleNamespace(start=lambda: started.append(True)))
    for path in (_checkpoint(tmp_path, 2), str(tmp_path / "non_persistent" / "global_step3")):
        os.makedirs(path, exist_ok=True)
        _TrainingRun.say_saved_in_background(run, path, 2)
    assert started == [True]


def test_a_run_whose_save_lacks_the_checkpoint_resumes_from_s3_and_never_from_an_incomplete_one(client, tmp_path):
    from megatron.checkpoint.engine import find_checkpoint

    uploaded = _checkpoint(tmp_path / "first", 4)
    location = S3Location.parse("s3://ckpts/run1")
    upload_checkpoint(client, location, uploaded, CHUNK)
    partial = _checkpoint(tmp_path / "first", 8)
    with pytest.raises(CheckpointError):
        upload_checkpoint(_Recording(client, fail_after_parts=2), location, partial, CHUNK)
    client.put_object(Bucket="ckpts", Key="run1/latest", Body=b"global_step8")  # as if: names the incomplete one
    fresh = tmp_path / "fresh"
    with pytest.raises(CheckpointError, match="no checkpoint .*global_step8"):  # not complete in S3: not downloaded
        find_checkpoint(args_for(fresh, s3_path="s3://ckpts/run1", iteration=8))
    found = find_checkpoint(args_for(fresh, s3_path="s3://ckpts/run1"))  # the newest complete one
    assert found.path == str(fresh / "global_step4") and (fresh / "latest").read_text() == "global_step4"
    for relative in _all_files(uploaded):
        with open(os.path.join(uploaded, relative), "rb") as mine, \
                open(os.path.join(found.path, relative), "rb") as got:
            assert mine.read() == got.read(), relative
    assert sorted(os.listdir(fresh)) == ["global_step4", "latest"]  # no staging directory left
    assert remote_complete(client, location, found.path)  # not uploaded again by the resumed run
