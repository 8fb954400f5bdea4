"""``manage.py up``: the whole system in one foreground command.

Migrates, loads the demo corpus, then runs the web server (uvicorn, ASGI for
streaming), Celery workers for every queue, and beat, as child processes whose output
is prefixed with their name; with ``GPU_POOL_MODEL`` set, also one engine server (vLLM)
per entry of ``GPU_DEVICES`` (one on the CPU when empty), restarted when it dies, and
registers that pool. Ctrl-C (or SIGTERM) stops the children gracefully, then the embedded
PostgreSQL and Redis if this install uses them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from inference.serving import EngineServer, PoolConfig, pool_register
from ragsite import embedded
from ragsite.env import redact_url


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's environment
    process: subprocess.Popen | None = None
    reader: threading.Thread | None = field(default=None, repr=False)


class Command(BaseCommand):
    help = "Run the web server, Celery workers for every queue and beat, on the configured (or embedded) services."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("RAGSITE_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("RAGSITE_PORT", "8000")))
        parser.add_argument("--no-demo", action="store_true", help="Do not load the demo corpus.")
        parser.add_argument(
            "--ingest-concurrency", type=int, default=2, help="Processes for the ingest and default queues."
        )
        parser.add_argument(
            "--gpu-concurrency",
            type=int,
            default=None,
            help="Generations the gpu queue's worker holds at once (default: GPU_WORKER_CONCURRENCY, 64).",
        )
        parser.add_argument(
            "--remote-concurrency",
            type=int,
            default=None,
            help="Threads for the remote queue (default: REMOTE_WORKER_CONCURRENCY, 16).",
        )

    def handle(self, *args, **options):
        # Line-buffered, so the supervisor's lines interleave correctly with the children's.
        sys.stdout.reconfigure(line_buffering=True)
        self._stopping = threading.Event()
        self._output_lock = threading.Lock()
        host, port = options["host"], options["port"]
        self._refuse_busy_port(host, port)

        embedded_pg = " (embedded)" if settings.EMBEDDED_POSTGRES else ""
        embedded_redis = " (embedded)" if settings.EMBEDDED_REDIS else ""
        self.stdout.write(f"database: {redact_url(settings.DATABASE_URL)}{embedded_pg}")
        self.stdout.write(f"redis:    {redact_url(settings.REDIS_URL)}{embedded_redis}")
        call_command("migrate", interactive=False, verbosity=1)
        if not options["no_demo"]:
            call_command("seed_demo")

        self._metrics_dir = self._fresh_metrics_dir()
        children = self._children(host, port, options)
        self._engines = self._engine_servers()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._request_stop)
        exit_code = 0
        try:
            for engine in self._engines:
                engine.start()
            for child in children:
                self._start(child)
            exit_code = self._supervise(children, host, port)
        finally:
            self._stop_engines()
            self._stop_children(children)
            self._stop_embedded_services()
        if exit_code:
            raise CommandError("a child process exited unexpectedly; everything was stopped")

    # ------------------------------------------------------------------ children

    def _children(self, host: str, port: int, options) -> list[Child]:
        python = sys.executable
        schedule = str(embedded.var_dir() / "celerybeat-schedule")
        remote_concurrency = options.get("remote_concurrency") or settings.REMOTE_WORKER_CONCURRENCY
        return [
            Child(
                "web",
                [
                    python,
                    "-m",
                    "uvicorn",
                    "ragsite.asgi:application",
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--lifespan",
                    "off",
                    "--timeout-graceful-shutdown",
                    "10",
                ],
            ),
            self._worker(python, "ingest", "ingest,default", "-c", str(options["ingest_concurrency"])),
            *self._gpu_children(python, options),
            # Remote generation waits on the network: threads, many calls per process.
            self._worker(python, "remote", "remote", "--pool", "threads", "-c", str(remote_concurrency)),
            Child("beat", [python, "-m", "celery", "-A", "ragsite", "beat", "-s", schedule, "--loglevel", "INFO"]),
        ]

    def _gpu_children(self, python: str, options) -> list[Child]:
        """The gpu queue's worker: a dispatcher whose threads each stream one generation from
        a pool device's engine server, which batches them (so it needs no GPU itself)."""
        concurrency = options.get("gpu_concurrency") or settings.GPU_WORKER_CONCURRENCY
        return [self._worker(python, "gpu", "gpu", "--pool", "threads", "-c", str(concurrency))]

    @staticmethod
    def _worker(python: str, name: str, queues: str, *options: str) -> Child:
        """A Celery worker named ``<name>@<host>`` consuming ``queues``, with ``options`` (pool, concurrency)."""
        argv = [python, "-m", "celery", "-A", "ragsite", "worker", "-Q", queues, "-n", f"{name}@%h", *options]
        return Child(name, [*argv, "--loglevel", "INFO", "--without-gossip", "--without-mingle"])

    def _engine_servers(self) -> list[EngineServer]:
        """With GPU_POOL_MODEL set: register the pool, and make one engine server per device
        unless GPU_POOL_DEVICE_URLS says they run elsewhere."""
        if not settings.GPU_POOL_MODEL:
            return []
        config = PoolConfig.from_settings()
        if settings.GPU_POOL_DEVICE_URLS:
            pool_register(config, list(settings.GPU_POOL_DEVICE_URLS))
            self.stdout.write(f"pool {config.name}: engine servers at {', '.join(settings.GPU_POOL_DEVICE_URLS)}")
            return []
        if not os.path.exists(config.python):
            raise CommandError(
                f"GPU_POOL_MODEL is set but vLLM's Python ({config.python}) does not exist: run `python3 dev.py up`, "
                "which installs it into .venv-vllm/, or set VLLM_PYTHON"
            )
        engines = []
        for index in range(len(config.devices)):
            engine = EngineServer.for_device(config, index)
            engine.log = self._engine_log(engine.name)
            engines.append(engine)
        pool_register(config, [engine.url for engine in engines])
        self.stdout.write(
            f"pool {config.name}: {config.model} ({config.speculative}, k={config.k}) on {len(engines)} device(s)"
        )
        return engines

    def _engine_log(self, name: str):
        def log(line: str) -> None:
            with self._output_lock:
                self.stdout.write(f"{name:<7}| {line}")
                self.stdout.flush()

        return log

    def _stop_engines(self) -> None:
        for engine in self._engines:
            engine.stop()

    def _child_env(self, child: Child) -> dict[str, str]:
        env = dict(os.environ, **child.env)
        # Children reuse the services this process resolved instead of each racing to start them.
        env["DATABASE_URL"] = settings.DATABASE_URL
        env["REDIS_URL"] = settings.REDIS_URL
        env["PYTHONUNBUFFERED"] = "1"
        # Prometheus multiprocess mode: every child writes its metrics there (ragsite/metrics.py).
        env["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir
        return env

    def _fresh_metrics_dir(self) -> str:
        """PROMETHEUS_MULTIPROC_DIR (default ``var/prometheus``) with the previous run's files
        removed: counters start at zero with the processes, as Prometheus expects."""
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or str(embedded.var_dir() / "prometheus")
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if name.endswith(".db"):
                os.remove(os.path.join(path, name))
        return path

    def _start(self, child: Child) -> None:
        # A new session: Ctrl-C reaches only this supervisor, which then stops children in order.
        child.process = subprocess.Popen(
            child.argv,
            env=self._child_env(child),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        child.reader = threading.Thread(target=self._relay, args=(child,), daemon=True)
        child.reader.start()

    def _relay(self, child: Child) -> None:
        assert child.process and child.process.stdout
        for line in child.process.stdout:
            with self._output_lock:
                self.stdout.write(f"{child.name:<7}| {line.rstrip()}")
                self.stdout.flush()

    def _supervise(self, children: list[Child], host: str, port: int) -> int:
        """Wait for Ctrl-C; announce readiness once; stop everything if any child dies."""
        base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        started, announced = time.monotonic(), False
        # vLLM loads and compiles its model first: about 100 s on two CPU cores.
        patience = 900 if self._engines else 120
        while not self._stopping.wait(0.5):
            for engine in self._engines:  # a dead engine server is restarted, with backoff
                engine.supervise()
            for child in children:
                code = child.process.poll() if child.process else None
                if code is not None:
                    self.stderr.write(f"{child.name} exited with status {code}; stopping everything")
                    return 1
            if not announced:
                announced = self._ready(base)
                if announced:
                    self._announce(base)
                elif time.monotonic() - started > patience:
                    self.stderr.write(f"not ready after {patience} s; see {base}/readyz")
                    announced = True
        return 0

    def _request_stop(self, signum, frame) -> None:
        if not self._stopping.is_set():
            self.stdout.write(f"\nreceived {signal.Signals(signum).name}: stopping")
        self._stopping.set()

    def _stop_children(self, children: list[Child]) -> None:
        running = [c for c in children if c.process and c.process.poll() is None]
        for child in running:
            child.process.send_signal(signal.SIGTERM)  # Celery: warm shutdown; uvicorn: graceful
        deadline = time.monotonic() + 30
        for child in running:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stderr.write(f"{child.name} did not stop in time; killing it")
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
        for child in children:
            if child.reader:
                child.reader.join(timeout=2)
        self.stdout.write("all processes stopped")

    def _stop_embedded_services(self) -> None:
        if settings.EMBEDDED_REDIS and embedded.default_redis().stop():
            self.stdout.write("embedded redis stopped")
        if settings.EMBEDDED_POSTGRES:
            from django.db import connections

            connections.close_all()
            if embedded.default_postgres().stop():
                self.stdout.write("embedded postgres stopped")

    # ------------------------------------------------------------------ readiness

    def _refuse_busy_port(self, host: str, port: int) -> None:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise CommandError(
                    f"cannot listen on {host}:{port} ({exc.strerror}); pass --port or set RAGSITE_PORT"
                ) from None

    def _ready(self, base: str) -> bool:
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=5) as response:  # noqa: S310 (http URL built here)
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _announce(self, base: str) -> None:
        lines = [f"ready: {base}/  (admin: {base}/admin/, readiness: {base}/readyz)"]
        if not get_user_model().objects.filter(is_superuser=True).exists():
            lines.append(f"create the first administrator with: {sys.executable} manage.py createsuperuser")
        lines.append("press Ctrl-C to stop everything")
        with self._output_lock:
            for line in lines:
                self.stdout.write(self.style.SUCCESS(line))
