"""``manage.py up`` (what ``python3 dev.py up`` runs) on the embedded defaults, twice.

The whole system starts with no DATABASE_URL or REDIS_URL: embedded PostgreSQL and
Redis, migrations, the demo corpus, uvicorn, workers for every queue and beat. Ctrl-C
stops all of it, and a second run finds the first run's data.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(var_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(RAGSITE_VAR_DIR=str(var_dir), PYTHONUNBUFFERED="1")
    return env


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class System:
    def __init__(self, var_dir: Path, log_path: Path):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = _env(var_dir)
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "up", "--port", str(self.port), "--ingest-concurrency", "1"],
                cwd=PROJECT_ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log()[-5000:]
            try:
                status, body = _get(f"{self.base}/readyz")
            except OSError:
                status = 0
            if status == 200:
                return json.loads(body)
            time.sleep(0.5)
        raise AssertionError(f"not ready in {timeout} s:\n{self.log()[-5000:]}")

    def manage(self, *args: str, **extra_env: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=PROJECT_ROOT,
            env={**self.env, **extra_env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def interrupt(self) -> int:
        os.kill(self.process.pid, signal.SIGINT)  # what Ctrl-C sends to the foreground process
        return self.process.wait(timeout=90)


def _admin_login(base: str, username: str, password: str) -> str:
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    opener.open(f"{base}/admin/login/", timeout=10).read()
    csrf = next(cookie.value for cookie in jar if cookie.name == "csrftoken")
    form = urllib.parse.urlencode(
        {"username": username, "password": password, "csrfmiddlewaretoken": csrf, "next": "/admin/"}
    ).encode()
    request = urllib.request.Request(f"{base}/admin/login/", data=form, headers={"Referer": f"{base}/admin/login/"})
    with opener.open(request, timeout=10) as response:
        return response.geturl()


def test_up_runs_the_whole_system_and_a_second_run_keeps_the_data(tmp_path):
    var_dir = tmp_path / "var"
    first = System(var_dir, tmp_path / "first.log")
    try:
        ready = first.wait_ready()
        assert ready["status"] == "ready"
        assert {name: entry["ok"] for name, entry in ready["checks"]["queues"].items()} == {
            "ingest": True,
            "gpu": True,
            "remote": True,
            "default": True,
        }
        assert ready["checks"]["database"]["pgvector"] == "0.8.6"
        assert _get(f"{first.base}/healthz") == (200, b'{"status": "ok"}')
        status, page = _get(f"{first.base}/admin/login/")
        assert status == 200 and b'name="username"' in page
        status, css = _get(f"{first.base}/static/css/site.css")
        assert status == 200 and b"--accent" in css

        first.manage(
            "createsuperuser",
            "--noinput",
            "--username",
            "ops",
            "--email",
            "ops@example.com",
            DJANGO_SUPERUSER_PASSWORD="correct horse battery staple",
        )
        count = "from search.models import Document; print(Document.objects.count())"
        assert first.manage("shell", "-v", "0", "-c", count).strip() == "6"
    finally:
        code = first.interrupt()
    log = first.log()
    assert code == 0, log[-5000:]
    assert "received SIGINT: stopping" in log
    assert "embedded redis stopped" in log and "embedded postgres stopped" in log
    assert not (var_dir / "pgdata" / "postmaster.pid").exists()

    second = System(var_dir, tmp_path / "second.log")
    try:
        second.wait_ready()
        assert "demo corpus: 0 documents added, 6 already present" in second.log()
        assert second.manage("shell", "-v", "0", "-c", count).strip() == "6"
        assert _admin_login(second.base, "ops", "correct horse battery staple") == f"{second.base}/admin/"
    finally:
        assert second.interrupt() == 0, second.log()[-5000:]


def test_each_listed_gpu_gets_a_worker_that_sees_only_that_device(settings):
    from ragsite.management.commands.up import Command

    settings.GPU_DEVICES = ["0", "3"]
    children = Command()._gpu_children("python", {"gpu_workers": 4})
    assert [child.name for child in children] == ["gpu0", "gpu3"]
    assert [child.env for child in children] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "3"}]
    for child, device in zip(children, ["0", "3"], strict=True):
        argv = child.argv
        assert argv[argv.index("-Q") + 1] == "gpu"
        assert argv[argv.index("-n") + 1] == f"gpu{device}@%h"
        assert argv[argv.index("-c") + 1] == "1"
        assert argv[argv.index("--prefetch-multiplier") + 1] == "1"

    settings.GPU_DEVICES = []
    [cpu] = Command()._gpu_children("python", {"gpu_workers": 2})
    assert cpu.name == "gpu" and cpu.env == {}
    assert cpu.argv[cpu.argv.index("-c") + 1] == "2"
