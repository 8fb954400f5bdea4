"""The test OpenID provider as a process the tests start, stop and start again."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import PROJECT_ROOT, WorkerProcess, wait_until_answering


class IdentityProvider:
    """``python -m tests.identity_provider.serve`` on a free loopback port, its data in ``data``."""

    def __init__(self, data: Path):
        self.data = data
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.issuer = f"{self.base_url}/o"
        self.discovery_url = f"{self.issuer}/.well-known/openid-configuration"
        self.server: WorkerProcess | None = None

    def start(self) -> None:
        log_path = self.data / f"provider-{time.monotonic_ns()}.log"
        self.data.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.identity_provider.serve", str(self.port), str(self.data)],
                cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.server = WorkerProcess(name=f"provider:{self.port}", process=process, log_path=log_path)
        wait_until_answering(self.server, self.discovery_url, "the identity provider")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(timeout=10)
            self.server = None

    def control(self, what: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.base_url}/control/{what}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def client_set(self, client_id: str, client_secret: str, site_url: str) -> None:
        self.control(
            "client",
            {
                "client_id": client_id,
                "client_secret": client_secret,
                "redirect_uris": [f"{site_url}/accounts/oidc/callback/"],
                "post_logout_redirect_uris": [f"{site_url}/accounts/login/"],
            },
        )

    def user_set(self, username: str, *, groups=(), email: str = "", name: str = "", active: bool = True) -> str:
        """The user's subject (the provider's user id)."""
        body = {"username": username, "password": "provider-password", "groups": list(groups), "email": email,
                "name": name, "active": active}  # fmt: skip
        return self.control("user", body)["subject"]

    def faults_set(self, **faults) -> None:
        self.control("faults", faults)
