"""A real S3-compatible server for the s3_path tests: moto's, in server mode, on 127.0.0.1 (a thread of the test
process, so that the test can lower its smallest part size), reached over HTTP by boto3 as a user's run reaches
AWS: through the environment (AWS_ENDPOINT_URL and test credentials) that the tests export to the runs too."""

import contextlib
import socket
from typing import Dict, Iterator


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def s3_server(smallest_part: int = 1024) -> Iterator[Dict[str, str]]:
    """Yields the environment that points boto3 at the server; multipart parts may be as small as
    ``smallest_part`` bytes (AWS: 5 MiB), so a tiny checkpoint is uploaded in several chunks."""
    import moto.s3.models
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    previous = moto.s3.models.S3_UPLOAD_PART_MIN_SIZE
    moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = smallest_part
    server.start()
    try:
        yield {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
    finally:
        server.stop()
        moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = previous


def remote_files(client, bucket: str, prefix: str) -> Dict[str, bytes]:
    """{key below ``prefix``/: the object's bytes}."""
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            found[item["Key"][len(prefix) + 1:]] = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
    return found
