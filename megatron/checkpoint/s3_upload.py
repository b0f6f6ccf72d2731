"""Uploading complete checkpoints to S3 (s3_path, s3_chunk_size), as GPT-NeoX does, never a partial one.

What is uploaded, when: each checkpoint of ``save`` once it is complete (COMPLETE and checksums.xxh128 written,
megatron.checkpoint.engine.complete_checkpoint), by rank 0, on a background thread, to
``s3://<bucket>/<prefix>/<global_stepN>/<file>``: every file in it, those larger than s3_chunk_size as a multipart
upload of s3_chunk_size parts; then ``<global_stepN>/COMPLETE`` last; then ``<prefix>/latest`` (the tag). A remote
checkpoint is complete only when its COMPLETE object exists and records (metadata ``manifest-xxh128``) the digest of
the local manifest it was uploaded from: an upload cut short (the process killed, the network down) leaves no
COMPLETE, and is finished on the next sync (at the next save, or the next start), which skips the objects already
uploaded with the digest the manifest gives them (metadata ``xxh128``) and aborts the multipart uploads left
open. Non-persistent checkpoints are not uploaded (they are replaced at their next interval).

Rank 0 uploads every rank's files: it already reads them all to write the manifest before COMPLETE, so ``save`` is
on a file system every node sees (GPT-NeoX uploads from rank 0 for the same reason), and one uploader orders the
objects (COMPLETE last) without a cross-node handshake.

Credentials, region and endpoint are boto3's own (AWS_ACCESS_KEY_ID / AWS_PROFILE / an instance role;
AWS_DEFAULT_REGION; AWS_ENDPOINT_URL for an S3-compatible server such as MinIO): nothing S3-specific is stored in the
config. A failure never touches the local checkpoint; it is said at once, naming the bucket and key, and retried
at the next sync."""

import os
import shutil
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.checkpoint.format import COMPLETE_MARKER, LATEST_FILE, complete_tags, tag_iteration
from megatron.checkpoint.integrity import UNLISTED, checkpoint_files, file_digest, manifest_of, read_manifest
from megatron.checkpoint.s3_location import MIN_AWS_PART, S3Location
from megatron.errors import CheckpointError
from megatron.utils.optional_deps import require

DIGEST_KEY = "xxh128"
"""Object metadata: the XXH3-128 of the file, as the checkpoint's manifest lists it."""
MANIFEST_DIGEST_KEY = "manifest-xxh128"
"""COMPLETE's metadata: the XXH3-128 of the manifest of the checkpoint uploaded (which local checkpoint it is)."""
MAX_PARTS = 10000
"""S3's most parts in one multipart upload."""


def s3_client():
    """boto3's S3 client, configured from the environment as it is now (the module docstring): a session of its own,
    not boto3's default one, which keeps the credentials it found first."""
    boto3 = require("boto3", "s3_path", "s3")
    return boto3.session.Session().client("s3")


def failure_reason(exc: BaseException) -> str:
    """What went wrong, in words that point at the fix (credentials, bucket, endpoint, chunk size)."""
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return (f"no usable AWS credentials ({exc}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                f"AWS_PROFILE, or run where an instance role is attached")
    error = (getattr(exc, "response", None) or {}).get("Error")
    if error:  # botocore's ClientError and its modeled subclasses (NoSuchBucket...)
        code, message = error.get("Code", "?"), error.get("Message", "")
        hints = {"NoSuchBucket": "the bucket does not exist; create it or fix s3_path",
                 "404": "the bucket does not exist; create it or fix s3_path",
                 "AccessDenied": "the credentials may not write there; check their policy",
                 "403": "the credentials may not write there (or are wrong); check them and their policy",
                 "InvalidAccessKeyId": "the access key is unknown; check AWS_ACCESS_KEY_ID",
                 "SignatureDoesNotMatch": "the secret key is wrong; check AWS_SECRET_ACCESS_KEY",
                 "EntityTooSmall": f"s3_chunk_size is below the server's smallest part (AWS S3: {MIN_AWS_PART} "
                                   f"bytes); raise it"}
        return f"{code} {message}".strip() + (f": {hints[code]}" if code in hints else "")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError"):
        return f"{exc} (check the network, or AWS_ENDPOINT_URL for an S3-compatible server)"
    return f"{name}: {exc}"


def bucket_problem(client, location: S3Location) -> Optional[str]:
    """Why ``location``'s bucket cannot be reached with these credentials (checked before the first step), or None."""
    try:
        client.head_bucket(Bucket=location.bucket)
    except Exception as exc:  # noqa: BLE001 - botocore's errors, named by failure_reason
        return f"s3_path: cannot reach bucket '{location.bucket}' ({location.url()}): {failure_reason(exc)}"
    return None


def _head(client, bucket: str, key: str) -> Optional[Dict[str, Any]]:
    try:
        return client.head_object(Bucket=bucket, Key=key)
    except Exception as exc:  # noqa: BLE001
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        if code in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def _manifest_digest(path: str) -> str:
    manifest = manifest_of(path)
    return file_digest(os.path.join(path, manifest)) if manifest else ""


def remote_complete(client, location: S3Location, path: str) -> bool:
    """Whether local checkpoint ``path`` is in S3 complete: its COMPLETE object, uploaded from this manifest."""
    head = _head(client, location.bucket, location.key(os.path.basename(path), COMPLETE_MARKER))
    return head is not None and head.get("Metadata", {}).get(MANIFEST_DIGEST_KEY) == _manifest_digest(path)


def _upload_file(client, file: str, bucket: str, key: str, digest: str, chunk_size: int) -> None:
    """``file`` to ``key``: one PUT up to ``chunk_size`` bytes, else a multipart upload of ``chunk_size`` parts
    (aborted when a part fails, so no half-object is left behind)."""
    metadata = {DIGEST_KEY: digest}
    size = os.path.getsize(file)
    if -(-size // chunk_size) > MAX_PARTS:
        raise ValueError(f"the file's {size} bytes need {-(-size // chunk_size)} parts of s3_chunk_size={chunk_size} "
                         f"bytes, and S3 takes at most {MAX_PARTS}; raise s3_chunk_size")
    if size <= chunk_size:
        with open(file, "rb") as handle:
            client.put_object(Bucket=bucket, Key=key, Body=handle, Metadata=metadata)
        return
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key, Metadata=metadata)["UploadId"]
    try:
        parts = []
        with open(file, "rb") as handle:
            for number in range(1, MAX_PARTS + 1):
                chunk = handle.read(chunk_size)
                if not chunk:
                    break
                etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                          Body=chunk)["ETag"]
                parts.append({"PartNumber": number, "ETag": etag})
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                         MultipartUpload={"Parts": parts})
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        raise


def _abort_open_uploads(client, location: S3Location, tag: str) -> None:
    """Multipart uploads an earlier, killed upload of ``tag`` left open (they hold storage until aborted)."""
    listing = client.list_multipart_uploads(Bucket=location.bucket, Prefix=location.key(tag) + "/")
    for upload in listing.get("Uploads", []):
        client.abort_multipart_upload(Bucket=location.bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def upload_checkpoint(client, location: S3Location, path: str, chunk_size: int) -> Tuple[int, int]:
    """Upload complete local checkpoint ``path`` (the module docstring's order); returns (files, bytes) sent.
    CheckpointError naming the bucket and key of the object that failed."""
    tag = os.path.basename(path)
    manifest = read_manifest(path) or {}
    files = checkpoint_files(path) + [name for name in UNLISTED
                                      if name != COMPLETE_MARKER and os.path.isfile(os.path.join(path, name))]
    sent, sent_bytes = 0, 0
    key = location.key(tag, COMPLETE_MARKER)
    try:
        _abort_open_uploads(client, location, tag)
        client.delete_object(Bucket=location.bucket, Key=key)  # another checkpoint of this tag was there
        for relative in files:
            local = os.path.join(path, relative)
            digest = manifest.get(relative) or file_digest(local)
            key = location.key(tag, *relative.split(os.sep))
            head = _head(client, location.bucket, key)
            if head is not None and head.get("Metadata", {}).get(DIGEST_KEY) == digest and \
                    head.get("ContentLength") == os.path.getsize(local):
                continue  # uploaded by an earlier, interrupted upload
            _upload_file(client, local, location.bucket, key, digest, chunk_size)
            sent, sent_bytes = sent + 1, sent_bytes + os.path.getsize(local)
        key = location.key(tag, COMPLETE_MARKER)
        with open(os.path.join(path, COMPLETE_MARKER), "rb") as handle:
            client.put_object(Bucket=location.bucket, Key=key, Body=handle,
                              Metadata={MANIFEST_DIGEST_KEY: _manifest_digest(path)})
        key = location.key(LATEST_FILE)
        client.put_object(Bucket=location.bucket, Key=key, Body=tag.encode())
    except Exception as exc:  # noqa: BLE001 - botocore's errors, OSError, ValueError, named by failure_reason
        raise CheckpointError(f"uploading checkpoint {path} to {location.url(tag)} failed at "
                              f"s3://{location.bucket}/{key}: {failure_reason(exc)}; the local checkpoint is "
                              f"intact, and the upload is finished at the next save or start") from None
    return sent, sent_bytes


def _remote_tags(client, location: S3Location) -> List[str]:
    """The checkpoint tags under s3_path, newest first (complete or not)."""
    tags = []
    prefix = location.key() + "/" if location.prefix else ""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix, Delimiter="/"):
        tags += [entry["Prefix"][len(prefix):].rstrip("/") for entry in page.get("CommonPrefixes", [])]
    return sorted((tag for tag in tags if tag_iteration(tag) >= 0), key=tag_iteration, reverse=True)


def download_checkpoint(client, location: S3Location, save_dir: str, tag: Optional[str] = None) -> Optional[str]:
    """The remote checkpoint ``tag`` (default: the newest complete one) copied into ``save_dir`` when it is complete in
    S3; returns its local directory, or None when S3 holds none. The files arrive in a temporary
    directory, COMPLETE last, which is renamed into place only once COMPLETE's manifest digest is the downloaded
    manifest's: an interrupted download is never a checkpoint. CheckpointError naming the bucket and key."""
    key = location.key(LATEST_FILE)
    try:
        head = None
        for tag in [tag] if tag else _remote_tags(client, location):  # the newest complete one
            key = location.key(tag, COMPLETE_MARKER)
            head = _head(client, location.bucket, key)
            if head is not None:
                break
        if head is None:
            return None
        staging = os.path.join(save_dir, f"{tag}.s3-download")
        shutil.rmtree(staging, ignore_errors=True)
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=location.bucket, Prefix=location.key(tag) + "/"):
            for item in page.get("Contents", []):
                key = item["Key"]
                relative = key[len(location.key(tag)) + 1:]
                if relative and relative != COMPLETE_MARKER:
                    target = os.path.join(staging, *relative.split("/"))
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    client.download_file(location.bucket, key, target)
        key = location.key(tag, COMPLETE_MARKER)
        client.download_file(location.bucket, key, os.path.join(staging, COMPLETE_MARKER))
    except Exception as exc:  # noqa: BLE001 - botocore's errors and OSError, named by failure_reason
        raise CheckpointError(f"downloading checkpoint {location.url(tag or '')} into {save_dir} failed at "
                              f"s3://{location.bucket}/{key}: {failure_reason(exc)}") from None
    if head.get("Metadata", {}).get(MANIFEST_DIGEST_KEY) != _manifest_digest(staging):
        raise CheckpointError(f"checkpoint {location.url(tag)} changed while it was downloaded (its manifest is not "
                              f"the one its COMPLETE records); relaunch to download it again")
    path = os.path.join(save_dir, tag)
    shutil.rmtree(path, ignore_errors=True)  # an interrupted local save of the same tag
    os.replace(staging, path)
    return path


def pending_checkpoints(client, location: S3Location, save_dir: str) -> List[str]:
    """The complete checkpoints of ``save_dir`` not (completely) in S3, oldest first."""
    paths = [os.path.join(save_dir, tag) for tag in complete_tags(save_dir)]
    return [path for path in paths if not remote_complete(client, location, path)]


def _print(line: str, is_error: bool) -> None:
    print(line, file=sys.stderr if is_error else sys.stdout, flush=True)


class S3Uploads:
    """Rank 0's uploads of ``save``'s complete checkpoints, one sync at a time on a daemon thread: ``start`` after
    each checkpoint is complete (and once at the run's start, which finishes an interrupted upload), ``wait``
    before the next save (which may prune a checkpoint being uploaded), ``finish`` at the end (an error if the
    last sync failed). ``say(line, is_error)`` prints what each sync did."""

    def __init__(self, client, s3_path: str, chunk_size: int, save_dir: str,
                 say: Callable[[str, bool], None] = _print) -> None:
        self.client, self.location = client, S3Location.parse(s3_path)
        self.chunk_size, self.save_dir, self.say = chunk_size, save_dir, say
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[CheckpointError] = None

    def start(self) -> None:
        self.wait()
        self.thread = threading.Thread(target=self._sync, name="s3-upload", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def finish(self) -> None:
        self.wait()
        if self.error is not None:
            raise self.error

    def _sync(self) -> None:
        self.error = None
        try:
            for path in pending_checkpoints(self.client, self.location, self.save_dir):
                started = time.perf_counter()
                files, size = upload_checkpoint(self.client, self.location, path, self.chunk_size)
                self.say(f"uploaded checkpoint {path} to {self.location.url(os.path.basename(path))} "
                         f"({files} files, {size / 2**20:.1f} MiB) in {time.perf_counter() - started:.1f} s", False)
        except CheckpointError as exc:
            self.error = exc
        except Exception as exc:  # noqa: BLE001 - listing or heading the bucket failed
            self.error = CheckpointError(f"uploading the checkpoints of {self.save_dir} to {self.location.url()} "
                                         f"failed: {failure_reason(exc)}; the local checkpoints are intact")
        if self.error is not None:
            self.say(f"error: {self.error}", True)
