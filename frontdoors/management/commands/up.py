"""``manage.py up``: the whole system in one foreground command.

Migrates, loads the demo corpus, then runs the web server (uvicorn, ASGI for
streaming), Celery workers for every queue, and beat, as child processes whose output
is prefixed with their name; with ``GPU_POOL_MODEL`` set, also one engine server (vLLM)
per entry of ``GPU_DEVICES`` (one on the CPU when empty), and registers that pool. A
child that dies is restarted with backoff; one that keeps dying stops everything with
that reason (ragsite/supervision.py). Ctrl-C or SIGTERM stops the children gracefully
(a second one kills what is left), then the embedded PostgreSQL and Redis if this
install uses them, however ``up`` ends. docs/operations.md tells the whole story.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import psutil
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connection as database

from inference import demo_model
from inference.demo_model import DemoModelUnavailable
from inference.models import Provider
from inference.serving import EngineServer, PoolConfig, pool_off, pool_register, pool_warm, pool_warming
from ragsite import embedded
from ragsite.celery import unacked_restore
from ragsite.env import redact_url
from ragsite.redis import Role, redis_url
from ragsite.storage import StorageUnavailable, storage_check, storage_description
from ragsite.supervision import SupervisedProcess
from search.answering.reader import reader_description

# How long children get to stop after SIGTERM before they are killed.
STOP_TIMEOUT_S = 30.0


@dataclass
class Child:
    """What to run for one child: its name, command line and environment on top of up's."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    queues: tuple[str, ...] = ()  # a worker's: the only consumer of each under up


class Interrupted(BaseException):
    """A stop signal before the children run: unwinds whatever ``up`` was doing (a
    migration rolls back) to the clean-up. BaseException, as KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it."""


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
        self._stopping = threading.Event()  # a stop was asked for (or everything is stopping)
        self._hurry = threading.Event()  # asked twice: kill what is left instead of waiting
        # Until children start, a stop signal unwinds whatever up is doing (Interrupted);
        # from then on it only sets _stopping, so that no child is started and forgotten.
        self._signals_deferred = False
        # Reentrant: the signal handler writes from the main thread, maybe while it holds it.
        self._output_lock = threading.RLock()
        self._processes: list[SupervisedProcess] = []
        self._engines: list = []
        self._pool_failure: str | None = None
        self._owns_embedded = False
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        reason = None
        try:
            reason = self._run(options)
        except Interrupted:
            pass
        finally:
            # Whatever happened above (a refused start, an exception, a signal): nothing this
            # up started outlives it.
            self._signals_deferred = True
            self._stopping.set()
            self._stop(self._engines, "engine servers")
            self._stop(self._processes, "processes")
            self._stop_embedded_services()
        if reason:
            raise CommandError(f"{reason}; everything was stopped")

    def _run(self, options) -> str | None:
        """Start everything and supervise it; returns why everything must stop, or None."""
        host, port = options["host"], options["port"]
        self._owns_embedded = self._lock_embedded_services()
        self._refuse_busy_port(host, port)

        embedded_pg = " (embedded)" if settings.EMBEDDED_POSTGRES else ""
        embedded_redis = " (embedded)" if settings.EMBEDDED_REDIS else ""
        self.stdout.write(f"database: {redact_url(settings.DATABASE_URL)}{embedded_pg}")
        self.stdout.write(f"redis:    {redact_url(settings.REDIS_URL)}{embedded_redis}")
        for role in Role:  # those given a Redis of their own (REDIS_<ROLE>_URL)
            if redis_url(role) != settings.REDIS_URL:
                self.stdout.write(f"redis {role}: {redact_url(redis_url(role))}")
        self.stdout.write(f"uploads:  {storage_description()}")
        try:
            storage_check()
        except StorageUnavailable as exc:
            return str(exc)
        self.stdout.write(f"reader:   {reader_description()}")
        call_command("migrate", interactive=False, verbosity=1)
        if not options["no_demo"]:
            call_command("seed_demo")
        warning = self._connections_warning(options)
        if warning:
            self._say(warning)
        database.close()  # up itself needs none while it supervises

        self._metrics_dir = self._fresh_metrics_dir()
        pool = self._pool_config()
        self._signals_deferred = True
        for child in self._children(host, port, options):
            if self._stopping.is_set():
                return None
            process = SupervisedProcess(
                child.name,
                child.argv,
                self._child_env(child),
                log=self._relay_to(child.name),
                notice=self._say,
                on_death=self._tasks_back(child.queues) if child.queues else None,
            )
            self._processes.append(process)
            process.start()
        if pool is not None:
            # The web tier does not wait for the engines: answers are extractive until the
            # pool is warm, and the demo model may have to be converted first.
            threading.Thread(target=self._pool_start, args=(pool,), name="pool-start", daemon=True).start()
        return self._supervise(host, port)

    # ------------------------------------------------------------------ children

    @staticmethod
    def _connections_warning(options) -> str | None:
        """A warning when PostgreSQL takes fewer client connections than the children can
        hold at once under load (the web pool, each worker process and thread): past its
        limit a new connection is refused ("too many clients already") and its work fails."""
        held = {
            # Not pooled, the web process holds one a request in flight.
            "web": settings.DATABASE_POOL_MAX_SIZE if settings.DATABASE_POOL != "off" else settings.WEB_MAX_IN_FLIGHT,
            "ingest": options["ingest_concurrency"],
            "gpu": options.get("gpu_concurrency") or settings.GPU_WORKER_CONCURRENCY,
            "remote": options.get("remote_concurrency") or settings.REMOTE_WORKER_CONCURRENCY,
        }
        with database.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('max_connections')::int"
                " - current_setting('superuser_reserved_connections')::int"
                " - current_setting('reserved_connections')::int"
            )
            (available,) = cursor.fetchone()
        wanted = sum(held.values())
        if wanted <= available:
            return None
        parts = ", ".join(f"{name} {count}" for name, count in held.items())
        return (
            f"warning: PostgreSQL takes {available} client connections and the processes up starts can hold "
            f"{wanted} at once ({parts}): under load some will be refused. Raise PostgreSQL's max_connections, "
            "or lower DATABASE_POOL_MAX_SIZE, --gpu-concurrency or --remote-concurrency"
        )

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
        return Child(
            name, [*argv, "--loglevel", "INFO", "--without-gossip", "--without-mingle"], queues=tuple(queues.split(","))
        )

    @staticmethod
    def _tasks_back(queues: tuple[str, ...]):
        """When a worker dies: the tasks it had taken go back to their queues at once (under
        up it is their queues' only consumer), not after the visibility timeout."""

        def restore() -> str | None:
            count = unacked_restore(queues)
            return f"{count} unfinished task(s) back in {', '.join(queues)}" if count else None

        return restore

    def _engine_servers(self) -> list[EngineServer]:
        """The engine servers of the configured pool, built (not started) and registered."""
        config = self._pool_config()
        return self._engines_for(config) if config is not None else []

    def _pool_config(self) -> PoolConfig | None:
        """With a pool model (GPU_POOL_MODEL, "demo" by default): register the pool, warming,
        and return what its servers run, unless GPU_POOL_DEVICE_URLS says they run elsewhere."""
        if not settings.GPU_POOL_MODEL:
            if not settings.GPU_POOL_DEVICE_URLS and pool_off(settings.GPU_POOL_NAME):
                self.stdout.write(f"pool {settings.GPU_POOL_NAME}: off (GPU_POOL_MODEL=off); answers are extractive")
            return None
        try:
            config = PoolConfig.from_settings()
        except DemoModelUnavailable as exc:
            raise CommandError(str(exc)) from None
        if settings.GPU_POOL_DEVICE_URLS:
            pool_register(config, list(settings.GPU_POOL_DEVICE_URLS))
            self.stdout.write(f"pool {config.name}: engine servers at {', '.join(settings.GPU_POOL_DEVICE_URLS)}")
            return None
        if not os.path.exists(config.python):
            raise CommandError(
                f"GPU_POOL_MODEL is set but vLLM's Python ({config.python}) does not exist: run `python3 dev.py up`, "
                "which installs it into .venv-vllm/, or set VLLM_PYTHON (GPU_POOL_MODEL=off runs no pool)"
            )
        pool_register(config, config.device_urls(), warming=True)
        model = f"the demo model {demo_model.NAME}" if config.demo else config.model
        self.stdout.write(
            f"pool {config.name}: {model} ({config.speculative}, k={config.k}) on {len(config.devices)} device(s);"
            " warming: answers are extractive until it is ready"
        )
        return config

    def _engines_for(self, config: PoolConfig) -> list[EngineServer]:
        engines = []
        for index in range(len(config.devices)):
            engine = EngineServer.for_device(config, index)
            engine.log = self._relay_to(engine.name)
            engines.append(engine)
        return engines

    def _pool_start(self, config: PoolConfig) -> None:
        """On a thread of its own: the demo model converted if it must be, the engine servers
        started (then supervised with the other children), and the pool warmed once one
        answers; warming again while none does. A pool that cannot start stops everything
        with its reason, as a child that keeps dying does."""
        log = self._relay_to("pool")
        try:
            if config.demo:
                demo_model.prepare(log=log)
            with self._output_lock:
                if self._stopping.is_set():
                    return
                engines = self._engines_for(config)
                self._engines.extend(engines)
                for engine in engines:
                    engine.start()
            warm = False
            while not self._stopping.wait(1.0):
                # Warm, a pool is up while one of its servers runs (the supervisor restarts one
                # that dies); its /health is asked only while warming, not every second for ever.
                ready = any(engine.alive() and not engine.restarting for engine in engines) and (
                    warm or any(engine.ready() for engine in engines)
                )
                if ready and not warm:
                    provider = Provider.objects.get(name=config.name)
                    pool_warm(provider, log=log)
                    provider.refresh_from_db(fields=["first_token_timeout_s"])
                    log(
                        f"pool {config.name}: ready, answers are generated from now on (first-token timeout "
                        f"{provider.first_token_timeout_s:g} s)"
                    )
                    warm = True
                elif warm and not ready:
                    pool_warming(config.name, True)
                    log(f"pool {config.name}: no engine server answers; warming again, answers are extractive")
                    warm = False
        except Exception as exc:  # any failure to start the pool ends up, with its reason
            self._pool_failure = f"the GPU pool {config.name} could not start: {exc}"
        finally:
            database.close()

    def _relay_to(self, name: str):
        """Where a child's lines go: up's output, prefixed with the child's name."""

        def log(line: str) -> None:
            with self._output_lock:
                self.stdout.write(f"{name:<7}| {line}")
                self.stdout.flush()

        return log

    def _say(self, line: str) -> None:
        """The supervisor's own lines (a child died, restarted, gave up, stopping)."""
        with self._output_lock:
            self.stderr.write(line)
            self.stderr.flush()

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

    def _supervise(self, host: str, port: int) -> str | None:
        """Until a stop signal: restart children that die, announce readiness once; returns
        the reason to stop everything when a child keeps dying."""
        base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        started, announced = time.monotonic(), False
        # Readiness does not wait for the pool (it warms in the background).
        patience = 120
        while not self._stopping.wait(0.5):
            if self._pool_failure:
                return self._pool_failure
            for process in [*self._engines, *self._processes]:
                process.supervise()
                if process.gave_up:
                    return process.gave_up
            if not announced:
                announced = self._ready(base)
                if announced:
                    self._announce(base)
                elif time.monotonic() - started > patience:
                    self._say(f"not ready after {patience} s; see {base}/readyz")
                    announced = True
        return None

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._stopping.is_set():
            if not self._hurry.is_set():
                self._hurry.set()
                self._say(f"received {name} again: killing what is still running")
            return
        self._stopping.set()
        self._say(f"\nreceived {name}: stopping")
        if not self._signals_deferred:
            raise Interrupted(name)

    def _stop(self, processes: list[SupervisedProcess], what: str) -> None:
        """SIGTERM to each, then up to STOP_TIMEOUT_S for all of them (less when asked twice),
        then SIGKILL to the process group of any still running."""
        for process in processes:
            process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            while process.alive() and time.monotonic() < deadline and not self._hurry.is_set():
                time.sleep(0.1)
            if process.alive():
                self._say(f"{process.name} did not stop; killing it")
            if process.process is not None:
                process.kill()
        for process in processes:
            process.output_flush()
        if processes:
            self.stdout.write(f"all {what} stopped")

    def _stop_embedded_services(self) -> None:
        if not self._owns_embedded:
            return
        if settings.EMBEDDED_REDIS and embedded.default_redis().stop():
            self.stdout.write("embedded redis stopped")
        if settings.EMBEDDED_POSTGRES:
            from django.db import connections

            connections.close_all()
            if embedded.default_postgres().stop():
                self.stdout.write("embedded postgres stopped")

    def _lock_embedded_services(self) -> bool:
        """Whether this up owns the embedded services (and so stops them when it ends): it
        does unless another up runs on the same data folder, which is then refused."""
        if not (settings.EMBEDDED_POSTGRES or settings.EMBEDDED_REDIS):
            return False
        path = embedded.var_dir() / "up.lock"
        handle = open(path, "a+")  # held open, so locked, for up's whole life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise CommandError(
                f"another `manage.py up` (pid {holder}) runs on {embedded.var_dir()}: stop it first, or give this"
                " one a data folder of its own with RAGSITE_VAR_DIR"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._up_lock = handle
        return True

    # ------------------------------------------------------------------ readiness

    def _refuse_busy_port(self, host: str, port: int) -> None:
        """Bind as the web server will (SO_REUSEADDR: connections of a previous run still in
        TIME-WAIT do not count); a port another process listens on is refused, naming it."""
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise CommandError(
                    f"cannot listen on {host}:{port} ({exc.strerror}): {port_holder(port)};"
                    " stop it, or pass --port or set RAGSITE_PORT"
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


def port_holder(port: int) -> str:
    """Which process listens on a TCP port, as far as the system tells this user."""
    try:
        listeners = [
            c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
    except psutil.Error:
        listeners = []
    for connection in listeners:
        if connection.pid:
            try:
                process = psutil.Process(connection.pid)
                command = " ".join(process.cmdline()) or process.name()
            except psutil.Error:
                continue
            return f"process {connection.pid} listens there ({command[:200]})"
    return "another process listens there (the system does not say which to this user)"
