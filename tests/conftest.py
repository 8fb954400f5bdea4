from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.db import connection

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def database_url_for_current_test_db() -> str:
    """The URL of the database tests run against (pytest-django's ``test_`` copy)."""
    params = connection.get_connection_params()
    from urllib.parse import quote

    return f"postgresql://{params.get('user', 'postgres')}@{quote(params['host'], safe='')}/{params['dbname']}"


@dataclass
class WorkerProcess:
    name: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


@contextmanager
def celery_worker(
    queues: list[str],
    tmp_path: Path,
    *,
    concurrency: int = 1,
    pool: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[WorkerProcess]:
    """A real Celery worker in its own process group, on the test database and Redis.

    ``pool``: Celery's ``--pool`` (``threads`` for the ``remote`` queue); its default otherwise.
    Yields once the worker answers a broadcast ping, so tests never race its start-up.
    """
    from ragsite.celery import app

    name = f"test-{uuid.uuid4().hex[:8]}@localhost"
    log_path = tmp_path / f"{name.split('@')[0]}.log"
    env = {**os.environ, "DATABASE_URL": database_url_for_current_test_db(), "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "ragsite",
                "worker",
                "-Q",
                ",".join(queues),
                "-n",
                name,
                "-c",
                str(concurrency),
                *(["--pool", pool] if pool else []),
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
            ],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = WorkerProcess(name=name, process=process, log_path=log_path)
    broker = env.get("REDIS_BROKER_URL")
    if broker:  # a worker on a broker of its own is asked there, by an app set up as its own
        options = {"master_name": env["REDIS_SENTINEL_MASTER"]} if broker.startswith("sentinel:") else {}
        control = Celery(broker=broker, broker_transport_options=options, set_as_current=False).control
    else:
        control = app.control

    def answers() -> bool:
        return bool(control.ping(destination=[name], timeout=0.5))

    try:
        deadline = time.monotonic() + 60
        while not answers():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not start:\n{worker.log()[-4000:]}")
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def start_worker(tmp_path):
    """Factory fixture: ``with start_worker(["default"]) as worker: ...``;
    ``start_worker(["remote"], pool="threads", concurrency=4)`` for the remote queue."""

    def factory(queues: list[str], **kwargs):
        return celery_worker(queues, tmp_path, **kwargs)

    return factory


class QuickPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """PBKDF2 as deployed, in a thousand rounds: a hash names its rounds, so the processes the
    tests start (servers, workers), which hash as deployed, still check these passwords."""

    iterations = 1000


@pytest.fixture(scope="session", autouse=True)
def _quick_password_hashing(django_test_environment):
    """Passwords made in this process take a thousand PBKDF2 rounds, not a million: 0.24 s a
    user here, over a hundred times in a run (Django's advice for tests)."""
    from django.conf import settings

    settings.PASSWORD_HASHERS = ["tests.conftest.QuickPBKDF2PasswordHasher", *settings.PASSWORD_HASHERS]


@pytest.fixture(scope="session")
def upstream_server():
    """The OpenAI-protocol stand-in (tests/upstream_server.py) on a free loopback port."""
    from tests.upstream_server import serving

    with serving() as base_url:
        yield base_url


@contextmanager
def web_server(tmp_path: Path, *, env: dict[str, str] | None = None) -> Iterator[str]:
    """The site under uvicorn (ASGI, as ``manage.py up`` runs it) in its own process group,
    on the test database and Redis, on a free loopback port; yields its base URL
    (``http://127.0.0.1:PORT``) once ``/healthz`` answers. For tests that need a real HTTP
    server: the official ``openai`` client, a browser, Server-Sent Events."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path / f"web-{port}.log"
    env = {**os.environ, "DATABASE_URL": database_url_for_current_test_db(), "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "ragsite.asgi:application", "--host", "127.0.0.1", "--port", str(port),
             "--lifespan", "off", "--timeout-graceful-shutdown", "5"],
            cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    server = WorkerProcess(name=f"web:{port}", process=process, log_path=log_path)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(server, f"{base_url}/healthz", "the web server")
        yield base_url
    finally:
        server.stop(timeout=15)


def wait_until_answering(server: WorkerProcess, url: str, what: str, timeout_s: float = 60) -> None:
    """Until ``url`` answers 200; raises with ``server``'s log if it exits or takes too long."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if server.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start:\n{server.log()[-4000:]}")
        time.sleep(0.1)


@pytest.fixture
def start_web(tmp_path):
    """Factory fixture: ``with start_web() as base_url: ...`` (a uvicorn process on the test database)."""

    def factory(**kwargs):
        return web_server(tmp_path, **kwargs)

    return factory


@pytest.fixture
def browser():
    """Headless Chromium driven by Selenium (tests/browser.py); skipped, saying what to
    install, where Chromium or chromedriver is missing."""
    from tests.browser import chromium

    with chromium() as driver:
        yield driver


@pytest.fixture
def japanese_browser():
    """The same, asking for Japanese first (``Accept-Language: ja,en``), as browsers in Tokyo do."""
    from tests.browser import chromium

    with chromium(accept_language="ja,en") as driver:
        yield driver


# The first test to use a vLLM pool also waits for its server to start (~100 s alone, more on a
# busy machine), inside pytest-timeout's limit, which covers fixture set-up.
VLLM_TEST_TIMEOUT_S = 900
# The tests that start or use a vLLM server (``xdist_group``): each binds its threads to the same
# cores (inference.serving.engine_cpu_cores), so two at once would share them.
VLLM_GROUP = "vllm"


def pytest_collection_modifyitems(config, items):
    # schemathesis gives every operation's test its function's node id (tests/security/
    # test_api_fuzz.py); pytest-xdist schedules by node id, and ran one of 21. Each gets its own
    # name (which names the operation) as its id; any id still shared stops the run.
    for item in items:
        if not item.nodeid.endswith(f"::{item.name}"):
            _node_id_set(item, f"{item.parent.nodeid}::{item.name}")
    shared = sorted(nodeid for nodeid, count in Counter(item.nodeid for item in items).items() if count > 1)
    if shared:
        raise pytest.UsageError(f"tests share a node id, which pytest-xdist would run once: {shared}")
    for item in items:
        if {"ngram_pool", "draft_pool"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.timeout(VLLM_TEST_TIMEOUT_S))
            # In one test process together (dev.py runs pytest-xdist with --dist loadgroup): the
            # session's vLLM servers start once, and beside no other vLLM on the same core.
            item.add_marker(pytest.mark.xdist_group(VLLM_GROUP))
    if getattr(config.option, "loadgroup", False):  # a pytest-xdist worker, with --dist loadgroup
        # What pytest-xdist's own hook does, in pytest 9's terms: a group's tests are one unit
        # of work because their ids end in "@<group>".
        for item in items:
            groups = sorted({str(mark.args[0]) for mark in item.iter_markers("xdist_group")})
            if groups:
                _node_id_set(item, f"{item.nodeid}@{'_'.join(groups)}")


def _node_id_set(item: pytest.Item, nodeid: str) -> None:
    # pytest 9 keeps a node's id in ``_id``; pytest-xdist 3.8 (the latest) still sets the
    # ``_nodeid`` of pytest 8, which pytest 9 no longer reads, so its groups did not group.
    from _pytest.nodeid import NodeId

    item._id = NodeId.parse(nodeid)


# Started when the first test that uses each asks, not before: started with the session (so that
# their minutes overlapped the database tests), the fresh-clone run took longer, not less (two
# servers starting beside the first tests, then idle ones polling for the whole run).
@pytest.fixture(scope="session")
def ngram_pool(tmp_path_factory):
    """A vLLM server speculating with n-grams of the prompt (k=4), shared by the session."""
    from tests.pools import vllm_pool

    with vllm_pool(tmp_path_factory.mktemp("ngram-pool"), name="ngram-pool", speculative="ngram") as pool:
        yield pool


@pytest.fixture(scope="session")
def draft_pool(tmp_path_factory):
    """A vLLM server speculating with a draft model (the target itself: all accepted), shared."""
    from tests.pools import vllm_pool

    with vllm_pool(tmp_path_factory.mktemp("draft-pool"), name="draft-pool", speculative="draft") as pool:
        yield pool
