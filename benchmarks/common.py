"""Shared helpers: Django set-up, machine description, result files."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# The whole collection beside the checkout, else the first 500 of its abstracts (and all its questions) that the
# tests carry, so that a fresh clone runs every benchmark; a result names the corpus it used ("corpus").
_FULL_CRANFIELD = ROOT.parent / "shared" / "data" / "cranfield"
CRANFIELD = (
    _FULL_CRANFIELD if (_FULL_CRANFIELD / "corpus.jsonl").is_file() else ROOT / "tests" / "data" / "cranfield_500"
)


def django_setup() -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ragsite.settings")
    import django

    django.setup()


def server_url() -> str:
    """The URL of the project's database (starting the embedded server if that is the one)."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    from ragsite import embedded

    return embedded.postgres_url()


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@contextlib.contextmanager
def logs_folder(prefix: str, *, keep: bool):
    """The logs of a benchmark's processes: a temporary folder, kept (and named on stderr) with ``keep``."""
    if keep:
        folder = tempfile.mkdtemp(prefix=prefix)
        print(f"the processes' logs: {folder}", file=sys.stderr)
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield folder


@contextlib.contextmanager
def own_databases(database: str, redis_db: int, *, keep: bool = False):
    """A PostgreSQL database of the benchmark's own on the project's server (``DATABASE_URL``,
    else the embedded one), created empty and migrated, and Redis database ``redis_db`` of the
    project's server, emptied: a benchmark never meets a running system's rows, queues or
    streams. Django is set up on them inside; the database is dropped after unless ``keep``."""
    import psycopg
    from psycopg import sql

    def drop(conn):
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))

    server = server_url()
    with psycopg.connect(server, autocommit=True) as conn:
        drop(conn)
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    os.environ["DATABASE_URL"] = with_database(server, database)
    os.environ["REDIS_URL"] = redis_database_url(redis_db)
    django_setup()

    from django.core.management import call_command
    from django.db import connections

    try:
        call_command("migrate", verbosity=0)
        yield
    finally:
        connections.close_all()
        if not keep:
            with psycopg.connect(server, autocommit=True) as conn:
                drop(conn)


def redis_database_url(number: int) -> str:
    """Database ``number`` of the project's Redis (the embedded server unless REDIS_URL), emptied."""
    import redis

    url = os.environ.get("REDIS_URL")
    if not url:
        from ragsite import embedded

        url = embedded.redis_url()
    url = urlunsplit(urlsplit(url)._replace(path=f"/{number}"))
    redis.Redis.from_url(url).flushdb()
    return url


def percentile(values: list[float], q: int, digits: int | None = None) -> float | None:
    """The q-th percentile (1..99) with linear interpolation between the closest ranks
    (``statistics.quantiles``, inclusive); the value itself for one value, None for none."""
    if not values:
        return None
    ordered = sorted(values)
    value = ordered[0] if len(ordered) == 1 else statistics.quantiles(ordered, n=100, method="inclusive")[q - 1]
    return value if digits is None else round(value, digits)


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }


def report(name: str, result: dict, *, corpus: Path | None = None) -> None:
    """Write benchmarks/results/NAME.json (``BENCHMARK_RESULTS_DIR``, for the suite's smoke runs,
    writes elsewhere: their tiny figures never replace the published ones) and print the final JSON
    line; ``corpus``: the collection the benchmark read, named in the result (none for those that
    read none)."""
    folder = Path(os.environ.get("BENCHMARK_RESULTS_DIR") or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, **({"corpus": corpus.name} if corpus else {}), **result, "machine": machine()}
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload), flush=True)


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Process:
    """A child process in a session of its own (stopped with its children), its output in a log."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], folder: Path):
        self.name = name
        self.log_path = folder / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def system_start(
    folder: Path,
    *,
    workers: dict[str, list[str]],
    env: dict | None = None,
    web_env: dict | None = None,
    web_processes: int = 1,
) -> tuple[str, list[Process]]:
    """The web process (uvicorn, ASGI, on a free loopback port) and Celery workers (name -> their
    ``-Q``/pool arguments), as ``manage.py up`` runs them, on this process's database and Redis;
    returns the base URL and the processes once ``/healthz`` answers and every worker answers a
    ping. The caller stops them (``Process.stop``). ``web_processes`` > 1: that many uvicorn
    workers of one gunicorn on the port, as deployments run the web tier (deploy/kubernetes/web.yaml)."""
    from ragsite.celery import app

    python, port = sys.executable, free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAGSITE_ENV="development", **(env or {}))
    run_id = uuid.uuid4().hex[:8]
    if web_processes > 1:
        web = [python, "-m", "gunicorn", "ragsite.asgi:application", "-k", "uvicorn_worker.UvicornWorker",
               "--bind", f"127.0.0.1:{port}", "--workers", str(web_processes), "--graceful-timeout", "10"]  # fmt: skip
    else:
        web = [python, "-m", "uvicorn", "ragsite.asgi:application", "--host", "127.0.0.1", "--port", str(port),
               "--lifespan", "off", "--timeout-graceful-shutdown", "10", "--no-access-log"]  # fmt: skip
    worker = [python, "-m", "celery", "-A", "ragsite", "worker", "--loglevel", "WARNING",
              "--without-gossip", "--without-mingle"]  # fmt: skip
    processes = [Process("web", web, dict(env, **(web_env or {})), folder)]
    names = [f"{name}-{run_id}@localhost" for name in workers]
    for (name, arguments), node in zip(workers.items(), names, strict=True):
        processes.append(Process(name, [*worker, *arguments, "-n", node], env, folder))
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            dead = [process for process in processes if not process.alive()]
            if dead or time.monotonic() > deadline:
                culprit = dead[0] if dead else processes[0]
                raise SystemExit(f"{culprit.name} did not start:\n{culprit.log_tail()}")
            try:
                with urllib.request.urlopen(f"{base_url}/healthz", timeout=2) as response:  # noqa: S310 (http, loopback)
                    healthy = response.status == 200
            except OSError:
                healthy = False
            answered = {name for reply in (app.control.ping(destination=names, timeout=0.5) or []) for name in reply}
            if healthy and answered == set(names):
                return base_url, processes
            time.sleep(0.2)
    except BaseException:
        for process in processes:
            process.stop()
        raise


# --------------------------------------------------------------------------- requests


def multipart_form(fields: dict[str, str], files: dict[str, bytes]) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body of ``fields`` and ``files`` (each under the name ``files``,
    as the upload API takes them), and its Content-Type."""
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    for filename, content in files.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{filename}"\r\n\r\n'
        parts.append(head.encode() + content + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def sse_events(lines) -> Iterator[dict[str, str]]:
    """The events of a ``text/event-stream`` body read line by line (a response iterates so):
    each event's fields (``event``, ``id``, ``data``); comments and field-less blocks skipped."""
    fields: dict[str, str] = {}
    for raw in lines:
        line = raw.decode().rstrip("\n")
        if line:
            if not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
            continue
        if "event" in fields:
            yield fields
        fields = {}


# --------------------------------------------------------------------------- CPU of each part


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process and its descendants have used: the live ones, and
    those that ended and were waited for (``children_*``, as PostgreSQL's backends and Celery's
    pool processes are); None once the process is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for process in family:
        try:
            times = process.cpu_times()
        except psutil.Error:  # ended between the listing and now
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def service_pids() -> dict[str, int]:
    """The processes of this machine's PostgreSQL (its postmaster) and Redis serving the
    benchmark, where they run here: ``{"postgresql": pid, "redis": pid}``, without either that
    cannot be read (a server elsewhere, a role that may not read the data directory)."""
    import redis
    from django.db import DatabaseError, connection

    from ragsite.redis import Role, redis_client

    pids: dict[str, int] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SHOW data_directory")
            data = Path(cursor.fetchone()[0])
        pids["postgresql"] = int((data / "postmaster.pid").read_text().split()[0])
    except (DatabaseError, OSError, ValueError, IndexError) as error:
        print(f"PostgreSQL's CPU not measured: {error}", file=sys.stderr)
    try:
        pids["redis"] = int(redis_client(Role.BROKER).info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError) as error:
        print(f"Redis's CPU not measured: {error}", file=sys.stderr)
    return {name: pid for name, pid in pids.items() if tree_cpu_s(pid) is not None}
