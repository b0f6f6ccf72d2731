"""Where s3_path points (s3://bucket/prefix) and its rules, without torch or boto3: the config's validation, which
deepy.py runs before any worker starts, reads them (megatron.checkpoint.s3_upload does the uploading)."""

from dataclasses import dataclass
from typing import List, Optional

MIN_AWS_PART = 5 << 20
"""AWS S3's smallest part of a multipart upload but the last (EntityTooSmall below it)."""


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/prefix`` of s3_path."""
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, s3_path: str) -> "S3Location":
        bucket, _, prefix = s3_path[len("s3://"):].partition("/")
        return cls(bucket, prefix.strip("/"))

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def url(self, *parts: str) -> str:
        return f"s3://{self.bucket}/{self.key(*parts)}"


def s3_problems(s3_path: Optional[str], s3_chunk_size: int, save: Optional[str], chunk_set: bool) -> List[str]:
    """s3_path's rules: an s3:// URL naming a bucket, a positive chunk size, and a save directory to upload from;
    ``chunk_set``: s3_chunk_size is not its default (a setting of s3_path only)."""
    if s3_path is None:
        return [f"s3_chunk_size={s3_chunk_size} is a setting of s3_path; set s3_path or remove it"] if chunk_set else []
    problems = []
    if not s3_path.startswith("s3://") or not S3Location.parse(s3_path).bucket:
        problems.append(f"s3_path={s3_path!r} must be an S3 URL, s3://<bucket>[/<prefix>]")
    if s3_chunk_size < 1:
        problems.append(f"s3_chunk_size={s3_chunk_size} must be >= 1 byte (AWS S3 needs >= {MIN_AWS_PART} = 5 MiB)")
    if not save:
        problems.append(f"s3_path={s3_path!r} uploads the checkpoints written to save; set save")
    return problems
