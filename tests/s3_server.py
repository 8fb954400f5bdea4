"""An S3 API server for the tests: moto's, in server mode, as its own process, checking
credentials (``INITIAL_NO_AUTH_ACTION_COUNT``): the first actions make a user, its access key,
its policy and the bucket, and every request after that must be signed by that key."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import boto3

from tests.conftest import PROJECT_ROOT, WorkerProcess, wait_until_answering

BUCKET = "ragsite-uploads"
REGION = "us-east-1"
# The actions taken before credentials are checked: the user, its key, its policy, the bucket.
_UNCHECKED_ACTIONS = 4


class S3Server:
    def __init__(self, data: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        log_path = data / f"s3-{self.port}.log"
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_UNCHECKED_ACTIONS), "PYTHONUNBUFFERED": "1"}
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.server = WorkerProcess(name=f"s3:{self.port}", process=process, log_path=log_path)
        wait_until_answering(self.server, f"{self.endpoint_url}/moto-api/", "the S3 server")
        anyone = {"aws_access_key_id": "setup", "aws_secret_access_key": "setup", "region_name": REGION}
        iam = boto3.client("iam", endpoint_url=self.endpoint_url, **anyone)
        iam.create_user(UserName="ragsite")
        key = iam.create_access_key(UserName="ragsite")["AccessKey"]
        self.access_key_id, self.secret_access_key = key["AccessKeyId"], key["SecretAccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="ragsite", PolicyName="uploads", PolicyDocument=json.dumps(policy))
        self.client().create_bucket(Bucket=BUCKET)  # from here every request is checked

    def client(self, secret: str | None = None):
        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name=REGION, aws_access_key_id=self.access_key_id,
            aws_secret_access_key=secret or self.secret_access_key,
        )  # fmt: skip

    def env(self, *, bucket: str = BUCKET, secret: str | None = None) -> dict[str, str]:
        """What a deployment sets to keep its uploads in ``bucket`` here."""
        return {
            "STORAGE_S3_BUCKET": bucket,
            "STORAGE_S3_ENDPOINT_URL": self.endpoint_url,
            "STORAGE_S3_REGION": REGION,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": secret or self.secret_access_key,
        }

    def keys(self, bucket: str = BUCKET) -> list[str]:
        listed = self.client().list_objects_v2(Bucket=bucket)
        return sorted(entry["Key"] for entry in listed.get("Contents", []))

    def stop(self) -> None:
        self.server.stop(timeout=10)
