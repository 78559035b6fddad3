"""A local S3 endpoint for tests: ``moto.server`` on 127.0.0.1 at a free port, stopped afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Iterator

from cluster_helpers import free_ports


@contextmanager
def s3_endpoint(*buckets: str) -> Iterator[dict[str, str]]:
    """Start an S3 endpoint with ``buckets``; yields the environment variables that point pyarrow and boto3 at it."""
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": url,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, "moto.server exited early"
            try:
                with urllib.request.urlopen(url, timeout=2):
                    break
            except urllib.error.HTTPError:
                break
            except OSError:
                assert time.time() < deadline, "moto.server did not come up"
                time.sleep(0.3)
        client = s3_client(env)
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _credentials(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


def s3_client(env: dict[str, str]):
    """A boto3 S3 client of the endpoint ``env`` points at."""
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], **_credentials(env))


def bucket_keys(env: dict[str, str], bucket: str, prefix: str = "") -> list[str]:
    """Every object key in ``bucket`` under ``prefix``."""
    client = s3_client(env)
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [item["Key"] for item in page.get("Contents", [])]
    return keys
