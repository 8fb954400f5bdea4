"""``manage.py up`` (what ``python3 dev.py up`` runs) on the embedded defaults.

The whole system starts with no DATABASE_URL or REDIS_URL: embedded PostgreSQL and
Redis, migrations, the demo corpus, uvicorn, workers for every queue and beat. Ctrl-C
stops all of it, and a second run at once on the same port (the first run's connections
still in TIME-WAIT) finds the first run's data. A worker killed with SIGKILL is restarted
while the web server keeps answering; one killed again and again stops everything with
that reason. A start refused because another process holds the port leaves no
PostgreSQL or Redis behind.

Then what ``up`` builds for the GPU pool, without starting it: one threads worker for the
gpu queue, and with ``GPU_POOL_MODEL`` one vLLM server per ``GPU_DEVICES`` entry (their
commands and environments checked, none run) and the pool registered as a provider.
"""

from __future__ import annotations

import http.client
import http.cookiejar
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.conftest import PROJECT_ROOT, VLLM_GROUP, VLLM_TEST_TIMEOUT_S
from tests.polling import wait_for


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(var_dir: Path, **extra: str) -> dict[str, str]:
    # Its own database, Redis and metrics folder (var_dir/prometheus, emptied as it starts), as a
    # newcomer's run has: not the test session's.
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "PROMETHEUS_MULTIPROC_DIR"}}
    # No pool unless a test asks for one: the demo model's test starts it (vLLM takes minutes).
    env.update(RAGSITE_VAR_DIR=str(var_dir), PYTHONUNBUFFERED="1", GPU_POOL_MODEL="off")
    env.update(extra)
    return env


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class System:
    def __init__(self, var_dir: Path, log_path: Path, port: int | None = None, **env: str):
        self.port = port or _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = _env(var_dir, **env)
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

    def worker_pid(self, name: str) -> int | None:
        """The pid of up's Celery worker ``name`` (its main process), if one runs."""
        for child in psutil.Process(self.process.pid).children():
            try:
                if f"{name}@%h" in child.cmdline():
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        return None

    def document_status(self, name: str) -> str:
        code = f"from search.models import Document; print(Document.objects.get(source_name={name!r}).status)"
        return self.manage("shell", "-v", "0", "-c", code).strip()


def _processes_using(path: Path) -> list[str]:
    """Processes whose command line names ``path`` (the embedded PostgreSQL and Redis of a data folder)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if str(path) in command:
            found.append(f"{process.info['pid']}: {command}")
    return found


def _admin_login(base: str, username: str, password: str) -> str:
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    # The admin's sign-in page sends to the site's, where passwords and single sign-on both are.
    with opener.open(f"{base}/admin/login/?next=/admin/", timeout=10) as page:
        sign_in = page.geturl()
    assert sign_in == f"{base}/accounts/login/?next=%2Fadmin%2F"
    csrf = next(cookie.value for cookie in jar if cookie.name == "csrftoken")
    form = urllib.parse.urlencode(
        {"username": username, "password": password, "csrfmiddlewaretoken": csrf, "next": "/admin/"}
    ).encode()
    request = urllib.request.Request(sign_in, data=form, headers={"Referer": sign_in})
    with opener.open(request, timeout=10) as response:
        return response.geturl()


@pytest.mark.slow
def test_up_runs_the_whole_system_restarts_a_dead_worker_and_a_second_run_keeps_the_data(tmp_path):
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
        assert first.manage("shell", "-v", "0", "-c", count).strip() == "14"
        # A browser's kept-alive connection, open when Ctrl-C comes: the server closes it
        # first, so once the browser closes its side too, the server's side sits in
        # TIME-WAIT when the second run binds the port.
        kept = http.client.HTTPConnection("127.0.0.1", first.port, timeout=10)
        kept.request("GET", "/healthz")
        assert kept.getresponse().read() == b'{"status": "ok"}'
    finally:
        code = first.interrupt()
    log = first.log()
    assert code == 0, log[-5000:]
    assert "received SIGINT: stopping" in log
    assert "embedded redis stopped" in log and "embedded postgres stopped" in log
    assert not (var_dir / "pgdata" / "postmaster.pid").exists()
    # The server's FIN came when it stopped; the browser's answers it now. Not counting on
    # the urllib requests above, whose TIME-WAITs may have expired by now on a slow machine.
    kept.close()
    wait_for(
        lambda: [
            c
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_TIME_WAIT and c.laddr and c.laddr.port == first.port
        ],
        10,
        "the kept connection's server side in TIME-WAIT on the port",
    )

    # At once, on the same port.
    second = System(var_dir, tmp_path / "second.log", port=first.port)
    answers: list[int] = []
    polling = threading.Event()

    def poll_healthz():
        while not polling.is_set():
            answers.append(_get(f"{second.base}/healthz")[0])
            time.sleep(0.1)

    poller = threading.Thread(target=poll_healthz, daemon=True)
    try:
        second.wait_ready()
        assert "demo corpus: 0 documents added, 14 already present" in second.log()
        assert second.manage("shell", "-v", "0", "-c", count).strip() == "14"
        assert _admin_login(second.base, "ops", "correct horse battery staple") == f"{second.base}/admin/"

        # A worker killed while up runs: restarted, and no document is lost.
        poller.start()
        (tmp_path / "before.md").write_text("# Before\n\nUploaded before the ingest worker was killed.")
        (tmp_path / "after.md").write_text("# After\n\nUploaded once the ingest worker was back.")
        second.manage("ingest", str(tmp_path / "before.md"), "--queue")
        killed = second.worker_pid("ingest")
        os.kill(killed, signal.SIGKILL)
        not_ready = wait_for(
            lambda: (r := json.loads(_get(f"{second.base}/readyz")[1]))["status"] == "not ready" and r,
            30,
            "readyz saying not ready while the ingest queue has no worker",
        )
        assert not_ready["checks"]["queues"]["ingest"]["ok"] is False
        restarted = wait_for(
            lambda: (pid := second.worker_pid("ingest")) not in (None, killed) and pid, 60, "the worker restarted"
        )
        second.wait_ready()
        second.manage("ingest", str(tmp_path / "after.md"), "--queue")
        for name in ("before.md", "after.md"):
            wait_for(lambda name=name: second.document_status(name) == "indexed", 120, f"{name} indexed")
        log = second.log()
        assert "ingest: killed by SIGKILL after" in log and "restarting in 1 s (1 of 5 deaths allowed in 60 s)" in log
        assert f"ingest: restarted (pid {restarted})" in log
        polling.set()
        poller.join(timeout=15)
        assert answers and set(answers) == {200}, answers  # the web server never stopped answering

        # A worker that keeps dying stops everything, saying why.
        deadline = time.monotonic() + 180
        last = None
        while second.process.poll() is None and time.monotonic() < deadline:
            pid = second.worker_pid("ingest")
            if pid is not None and pid != last:
                os.kill(pid, signal.SIGKILL)
                last = pid
            time.sleep(0.05)
        code = second.process.wait(timeout=90)
    finally:
        polling.set()
        if second.process.poll() is None:
            second.interrupt()
    log = second.log()
    assert code == 1, log[-5000:]
    assert "ingest died 5 times in 60 s (last: killed by SIGKILL); everything was stopped" in log, log[-5000:]
    assert "embedded redis stopped" in log and "embedded postgres stopped" in log
    assert _processes_using(var_dir) == []


@pytest.mark.slow
def test_a_refused_start_names_the_port_holder_and_leaves_no_service_behind(tmp_path):
    """Another process really holds the port: up refuses, naming it, and stops the embedded
    PostgreSQL and Redis it had started."""
    var_dir = tmp_path / "var"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_PORT],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(holder.stdout.readline())
        refused = subprocess.run(
            [sys.executable, "manage.py", "up", "--port", str(port), "--no-demo"],
            cwd=PROJECT_ROOT,
            env=_env(var_dir),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
    output = refused.stdout + refused.stderr
    assert refused.returncode == 1, output
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use): process {holder.pid} listens there" in output
    assert "HOLD_A_PORT" in output  # its command line
    assert "embedded redis stopped" in output and "embedded postgres stopped" in output
    assert (var_dir / "pgdata" / "PG_VERSION").exists()  # it had started them
    assert _processes_using(var_dir) == []


# A process that listens on a free port, prints it, and waits (its name in its command line).
HOLD_A_PORT = """# HOLD_A_PORT
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(600)
"""


def test_a_port_in_time_wait_is_free_and_a_listened_one_is_refused_naming_its_process():
    from frontdoors.management.commands.up import Command

    # A connection whose server side closed first: TIME-WAIT on the server's port.
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()
        time.sleep(0.1)
        client.close()
    assert any(c.status == psutil.CONN_TIME_WAIT and c.laddr.port == port for c in psutil.net_connections(kind="tcp"))
    Command()._refuse_busy_port("127.0.0.1", port)  # free for the web server: no error

    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_PORT], stdout=subprocess.PIPE, text=True)
    try:
        busy = int(holder.stdout.readline())
        with pytest.raises(CommandError) as refused:
            Command()._refuse_busy_port("127.0.0.1", busy)
    finally:
        holder.kill()
        holder.wait()
    message = str(refused.value)
    assert message.startswith(f"cannot listen on 127.0.0.1:{busy} (Address already in use): process {holder.pid}")
    assert "HOLD_A_PORT" in message and message.endswith("stop it, or pass --port or set RAGSITE_PORT")


def gpu_argv(concurrency: int) -> list[str]:
    return [
        *("python", "-m", "celery", "-A", "ragsite", "worker", "-Q", "gpu", "-n", "gpu@%h"),
        *("--pool", "threads", "-c", str(concurrency), "--loglevel", "INFO", "--without-gossip", "--without-mingle"),
    ]


def test_the_gpu_queue_gets_one_threads_worker_whatever_the_devices(settings):
    """The worker only streams from the devices' engine servers, which batch: one process of
    threads, whatever GPU_DEVICES lists, and it sees every device (no CUDA_VISIBLE_DEVICES)."""
    from frontdoors.management.commands.up import Command

    settings.GPU_DEVICES = ["0", "3"]
    settings.GPU_WORKER_CONCURRENCY = 64
    [gpu] = Command()._gpu_children("python", {"gpu_concurrency": None})
    assert (gpu.name, gpu.env, gpu.argv) == ("gpu", {}, gpu_argv(64))

    [gpu] = Command()._gpu_children("python", {"gpu_concurrency": 8})  # --gpu-concurrency wins
    assert gpu.argv == gpu_argv(8)

    settings.GPU_DEVICES = []
    settings.GPU_WORKER_CONCURRENCY = 12
    [gpu] = Command()._gpu_children("python", {})
    assert (gpu.name, gpu.env, gpu.argv) == ("gpu", {}, gpu_argv(12))


@pytest.mark.django_db
def test_up_warns_when_postgresql_takes_fewer_connections_than_its_children_can_hold(settings):
    from frontdoors.management.commands.up import Command

    settings.DATABASE_POOL, settings.DATABASE_POOL_MAX_SIZE = "auto", 20
    settings.GPU_WORKER_CONCURRENCY, settings.REMOTE_WORKER_CONCURRENCY = 64, 16
    # The test database is an embedded PostgreSQL, tuned as up's: 300 connections, 3 reserved.
    assert Command._connections_warning({"ingest_concurrency": 2}) is None  # 102 of 297
    assert Command._connections_warning({"ingest_concurrency": 2, "gpu_concurrency": 259}) is None  # 297

    warning = Command._connections_warning({"ingest_concurrency": 2, "gpu_concurrency": 260})
    assert warning == (
        "warning: PostgreSQL takes 297 client connections and the processes up starts can hold 298 at once "
        "(web 20, ingest 2, gpu 260, remote 16): under load some will be refused. Raise PostgreSQL's "
        "max_connections, or lower DATABASE_POOL_MAX_SIZE, --gpu-concurrency or --remote-concurrency"
    )
    settings.DATABASE_POOL, settings.WEB_MAX_IN_FLIGHT = "off", 300  # a connection per request in flight
    assert "(web 300, ingest 2, gpu 64, remote 16)" in Command._connections_warning({"ingest_concurrency": 2})


def test_gpu_concurrency_replaced_gpu_workers():
    from frontdoors.management.commands.up import Command

    parser = Command().create_parser("manage.py", "up")
    assert parser.parse_args(["--gpu-concurrency", "8"]).gpu_concurrency == 8
    assert parser.parse_args([]).gpu_concurrency is None
    with pytest.raises(CommandError, match="unrecognized arguments: --gpu-workers 4"):
        parser.parse_args(["--gpu-workers", "4"])


@pytest.fixture
def pool_settings(settings):
    """A pool on two GPUs, n-gram speculation with k=5; vLLM's Python is this one (it exists)."""
    settings.GPU_POOL_MODEL = "/models/tiny"
    settings.GPU_POOL_NAME = "test-pool"
    settings.GPU_POOL_SPECULATIVE = "ngram"
    settings.GPU_POOL_DRAFT_MODEL = ""
    settings.GPU_POOL_SPECULATIVE_TOKENS = 5
    settings.GPU_POOL_MAX_MODEL_LEN = 2048
    settings.GPU_POOL_DTYPE = "float32"
    settings.GPU_POOL_PORT = 8200
    settings.GPU_POOL_EXTRA_ARGS = "--gpu-memory-utilization 0.85 --enforce-eager"
    settings.GPU_POOL_API_KEY = ""
    settings.GPU_POOL_DEVICE_URLS = []
    settings.GPU_DEVICES = ["0", "3"]
    settings.VLLM_PYTHON = sys.executable
    return settings


def up_command():
    import threading

    from frontdoors.management.commands.up import Command

    command = Command(stdout=io.StringIO(), stderr=io.StringIO())
    command._output_lock = threading.Lock()  # set by handle(), which these tests do not run
    return command


def vllm_argv_of(port: int, spec: dict | None, *extra: str) -> list[str]:
    argv = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
        *("--model", "/models/tiny", "--served-model-name", "/models/tiny"),
        *("--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--dtype", "float32"),
    ]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "summary"]
    return [*argv, *extra]


@pytest.mark.django_db
def test_up_builds_one_vllm_server_per_device_and_registers_the_pool(pool_settings):
    from inference.models import Provider, Route
    from inference.serving import PoolConfig, vllm_argv

    command = up_command()
    engines = command._engine_servers()

    assert [engine.name for engine in engines] == ["vllm0", "vllm3"]
    assert [engine.url for engine in engines] == ["http://127.0.0.1:8200/v1", "http://127.0.0.1:8201/v1"]
    ngram = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    extra = ("--gpu-memory-utilization", "0.85", "--enforce-eager")
    for index, (engine, device) in enumerate(zip(engines, ["0", "3"], strict=True)):
        assert engine.argv == vllm_argv_of(8200 + index, ngram, *extra)
        assert engine.argv == vllm_argv(PoolConfig.from_settings(), index)
        assert engine.env["CUDA_VISIBLE_DEVICES"] == device
        assert engine.env["PYTHONUNBUFFERED"] == "1" and "PROMETHEUS_MULTIPROC_DIR" not in engine.env
        assert engine.process is None  # built, not started
    # The servers' lines go to up's output, prefixed with their name.
    engines[1].log("INFO: Application startup complete.")
    output = command.stdout.getvalue()
    assert "pool test-pool: /models/tiny (ngram, k=5) on 2 device(s)" in output
    assert "vllm3  | INFO: Application startup complete." in output

    provider = Provider.objects.get(name="test-pool")
    assert (provider.kind, provider.base_url, provider.devices) == (
        "local",
        "",
        ["http://127.0.0.1:8200/v1", "http://127.0.0.1:8201/v1"],
    )
    assert (provider.model, provider.speculative_method, provider.speculative_k, provider.draft_model) == (
        "/models/tiny",
        "ngram",
        5,
        "",
    )
    assert (provider.context_window, provider.enabled) == (2048, True)
    [route] = Route.objects.all()
    assert (route.name, route.provider_id, route.is_default, route.max_tokens) == ("test-pool", provider.id, True, 512)

    # Started again with one GPU and a draft model: the same provider, updated; the same route.
    pool_settings.GPU_DEVICES = ["1"]
    pool_settings.GPU_POOL_SPECULATIVE = "draft"
    pool_settings.GPU_POOL_DRAFT_MODEL = "/models/draft"
    pool_settings.GPU_POOL_EXTRA_ARGS = ""
    pool_settings.GPU_POOL_API_KEY = "sk-pool-key"
    [engine] = up_command()._engine_servers()
    draft = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 5}
    assert engine.argv == vllm_argv_of(8200, draft, "--api-key", "sk-pool-key")
    assert (engine.name, engine.url, engine.env["CUDA_VISIBLE_DEVICES"]) == (
        "vllm1",
        "http://127.0.0.1:8200/v1",
        "1",
    )
    provider.refresh_from_db()
    assert (provider.devices, provider.speculative_method, provider.draft_model) == (
        ["http://127.0.0.1:8200/v1"],
        "draft",
        "/models/draft",
    )
    assert Provider.objects.count() == 1 and list(Route.objects.values_list("name", flat=True)) == ["test-pool"]


@pytest.mark.django_db
def test_without_gpus_up_builds_one_server_on_the_cpu_and_keeps_an_existing_default_route(pool_settings):
    from inference.models import Provider, Route

    upstream = Provider.objects.create(
        name="upstream", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://127.0.0.1:9/v1", model="m"
    )
    default = Route.objects.create(name="default", provider=upstream, is_default=True)
    pool_settings.GPU_DEVICES = []
    pool_settings.GPU_POOL_SPECULATIVE = "off"

    [engine] = up_command()._engine_servers()

    assert (engine.name, engine.url) == ("vllm", "http://127.0.0.1:8200/v1")
    assert engine.argv == vllm_argv_of(8200, None, "--gpu-memory-utilization", "0.85", "--enforce-eager")
    assert engine.env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert Provider.objects.get(name="test-pool").devices == ["http://127.0.0.1:8200/v1"]
    assert list(Route.objects.filter(is_default=True)) == [default]
    assert Route.objects.count() == 1


@pytest.mark.django_db
def test_engine_servers_that_run_elsewhere_are_registered_not_started(pool_settings, tmp_path):
    from inference.models import Provider

    urls = ["http://10.0.0.5:8000/v1", "http://gpu1.internal:8000/v1"]
    pool_settings.GPU_POOL_DEVICE_URLS = urls
    pool_settings.VLLM_PYTHON = str(tmp_path / "no-such-python")  # not needed: nothing is started
    command = up_command()

    assert command._engine_servers() == []
    assert Provider.objects.get(name="test-pool").devices == urls
    assert f"pool test-pool: engine servers at {', '.join(urls)}" in command.stdout.getvalue()

    # manage.py pool_register does the same for them.
    Provider.objects.filter(name="test-pool").update(devices=["http://old:8000/v1"])
    out = io.StringIO()
    call_command("pool_register", stdout=out)
    assert Provider.objects.get(name="test-pool").devices == urls
    assert out.getvalue() == f"pool test-pool: /models/tiny (ngram, k=5) on {', '.join(urls)}\n"


@pytest.mark.django_db
def test_compose_service_names_are_devices_pool_register_accepts(pool_settings):
    from inference.models import Provider

    urls = ["http://vllm-gpu0:8000/v1", "http://vllm-gpu1:8000/v1"]  # docker-compose.yml's services
    pool_settings.GPU_POOL_DEVICE_URLS = urls
    call_command("pool_register", stdout=io.StringIO())
    assert Provider.objects.get(name="test-pool").devices == urls


@pytest.mark.django_db
def test_no_pool_model_no_servers_and_a_missing_vllm_python_is_refused(pool_settings, tmp_path):
    from inference.models import Provider

    missing = str(tmp_path / "no-such-python")
    pool_settings.VLLM_PYTHON = missing
    with pytest.raises(CommandError) as refused:
        up_command()._engine_servers()
    assert f"vLLM's Python ({missing}) does not exist" in str(refused.value)
    assert not Provider.objects.exists()

    pool_settings.GPU_POOL_MODEL = ""
    assert up_command()._engine_servers() == []
    assert not Provider.objects.exists()
    with pytest.raises(CommandError, match="GPU_POOL_MODEL is empty"):
        call_command("pool_register")
    pool_settings.GPU_POOL_MODEL = "/models/tiny"
    with pytest.raises(CommandError, match="GPU_POOL_DEVICE_URLS is empty"):
        call_command("pool_register")


def _api(base: str, key: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{base}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _asked(system: System, key: str, question: str) -> dict:
    """A question through REST API v1, waited for until its answer is stored."""
    status, created = _api(system.base, key, "/api/v1/answers", {"question": question})
    assert status == 202, created

    def stored():
        _, answer = _api(system.base, key, f"/api/v1/answers/{created['id']}")
        return answer if answer["status"] in ("done", "failed") else None

    return wait_for(stored, 180, lambda: f"answer {created['id']} not stored:\n{system.log()[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(VLLM_TEST_TIMEOUT_S)  # it waits for vLLM to start, as the pools' tests do
@pytest.mark.xdist_group(VLLM_GROUP)  # its vLLM server would share the session pools' core
def test_up_serves_the_demo_model_out_of_the_box_and_answers_extractively_while_it_warms(tmp_path):
    """The README's run command on its defaults: the demo model is converted from its wheel,
    served by vLLM, and registered as the default route; the web tier is ready before it, with
    the pool shown warming and extractive answers that say why; then generated answers whose
    citations were checked, with the engine's own speculative figures."""
    var_dir = tmp_path / "var"
    system = System(var_dir, tmp_path / "up.log", GPU_POOL_MODEL="demo", GPU_POOL_PORT=str(_free_port()))
    try:
        ready = system.wait_ready()
        pool = ready["checks"]["pools"]["gpu-pool"]
        # vLLM alone takes a minute or more to start here: the web tier did not wait for it.
        assert (pool["ok"], pool["state"]) == (False, "warming"), pool
        make_key = (
            "from billing.client_keys import client_key_create; from search.models import Workspace; "
            "print(client_key_create(Workspace.objects.get(slug='demo'), 'up-test', scopes=['search', 'generate'])[1])"
        )
        key = system.manage("shell", "-v", "0", "-c", make_key).strip()
        indexed = "from search.models import Document; print(Document.objects.filter(status='indexed').count())"
        wait_for(
            lambda: system.manage("shell", "-v", "0", "-c", indexed).strip() == "14", 180, "the demo corpus indexed"
        )
        warming = _asked(system, key, "What is the per-diem for a full day in Zürich?")
        assert (warming["status"], warming["mode"]) == ("done", "extractive")
        assert warming["text"].startswith("Extracted from the sources (the generation model is still starting):")
        # The demo model writes English only: a Japanese question is answered from the sources
        # whether it has started or not, and says that is why, in Japanese.
        japanese_notice = "資料から抜粋しました（生成モデルが日本語で回答できないため）："
        warming_ja = _asked(system, key, "出張の日当はいくらですか")
        assert (warming_ja["status"], warming_ja["mode"]) == ("done", "extractive"), warming_ja
        assert warming_ja["text"].startswith(japanese_notice), warming_ja["text"]

        def pool_ready():
            status, body = _get(f"{system.base}/readyz")
            return status == 200 and json.loads(body)["checks"]["pools"]["gpu-pool"]["state"] == "ready"

        wait_for(pool_ready, 900, lambda: f"the pool never got ready:\n{system.log()[-5000:]}")
        log = system.log()
        assert "demo model: converting SmolLM2-135M-Instruct.Q4_1.gguf" in log
        assert "pool gpu-pool: ready, answers are generated from now on (first-token timeout" in log
        assert (var_dir / "models" / "SmolLM2-135M-Instruct-0.1.2" / "converted-from.json").is_file()

        answer = _asked(system, key, "What is the maximum speed of the Atlas-7 when unloaded?")
        assert (answer["status"], answer["route"]) == ("done", "gpu-pool"), answer
        # The pool generated it; its text is the model's, verified, unless nothing in it was
        # supported: then the sources' own sentences answer instead, and the answer says so.
        if answer["mode"] == "extractive":
            assert answer["verification"]["replaced_by"] == "extractive" and answer["stats"]["quoted_instead"]
        else:
            assert answer["mode"] == "generated"
        given = {source["number"] for source in answer["sources"]}
        assert 1 <= len(given) <= 3  # the demo route's max_sources
        japanese = _asked(system, key, "出張の日当はいくらですか")
        assert (japanese["status"], japanese["mode"], japanese["route"]) == ("done", "extractive", None), japanese
        assert japanese["text"].startswith(japanese_notice) and "3,000円" in japanese["text"], japanese["text"]
        # Every marker left in the text names a source the prompt gave, and each sentence's
        # span is the stored text's.
        cited = {n for citation in answer["citations"] for n in [citation["number"]]}
        assert cited <= given
        assert "original_text" in answer["verification"]
        for sentence in answer["sentences"]:
            assert 0 <= sentence["start"] < sentence["end"] <= len(answer["text"])
            assert set(sentence["citations"]) <= given
        if not answer["abstained"]:
            assert answer["grounded"] is not None
        stats = answer["stats"]
        assert stats["finish_reason"] in ("stop", "length", "repetition")
        if stats["finish_reason"] == "repetition":
            # The stream was cut before the usage chunk: the engine reported no speculative
            # figures, and the answer does not claim any; the cut is recorded instead.
            assert stats["speculative"] is None and "draft_tokens_proposed" not in stats
            assert stats["repetition"]["cut_at_char"] > 0
        else:
            spec = stats["speculative"]
            assert spec["draft_tokens_proposed"] > 0
            assert 0 <= spec["draft_tokens_accepted"] <= spec["draft_tokens_proposed"]
    finally:
        code = system.interrupt()
    log = system.log()
    assert code == 0, log[-5000:]
    assert "all engine servers stopped" in log
    assert not [line for line in _processes_using(var_dir / "models") if "vllm" in line]
