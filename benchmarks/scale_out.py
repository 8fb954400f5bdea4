"""Scale-out: the system as on several machines, under mixed load, with processes killed mid-run.

    python -m benchmarks.scale_out [--seconds 60] [--clients 8] [--docs 40] [--keep]

What runs, each its own process on 127.0.0.1: two web processes behind one port (gunicorn
with two uvicorn workers, as deploy/kubernetes/web.yaml runs the web tier), two workers on
``ingest,default`` and two on ``remote`` (threads), PostgreSQL behind a real PgBouncer in
transaction mode (``DATABASE_TRANSACTION_POOLING``; migrations on the direct URL), Redis,
uploads in an S3 server (moto's, in server mode), and the OpenAI-protocol stand-in of the
tests as the default route's upstream. ``--docs`` Cranfield documents are ingested first,
and each query searched and answered once, untimed (benchmarks.load's warm-up).

Load. ``--clients`` threads, each in a closed loop for ``--seconds``: a hybrid search (6 in
10), an answer asked through ``POST /api/v1/answers`` and read to its end from its event
stream (3 in 10; a stream cut by a killed web process is read again from its last event
with ``Last-Event-ID``, as an EventSource does), or the upload of a new document (1 in 10).
Kills: at 30 % of the run one of gunicorn's web workers (SIGKILL; gunicorn starts another),
at 45 % one ``ingest,default`` worker and at 60 % one ``remote`` worker, each killed whole
(its process group, SIGKILL) and started again 2 s later, as an orchestrator would. What a
killed worker had taken is delivered again once Redis's visibility timeout passes: 20 s
here (``CELERY_VISIBILITY_TIMEOUT``, with the task time limits under it), not the hour of
the defaults, so that the run can wait for it; and ledger rows a killed worker had read from
the outbox and not stored are taken over after 5 s (``LEDGER_CLAIM_IDLE_S``, 60 s by default)
by the run's own drain, which plays beat's ``ledger_drain`` (no beat runs here); it plays
``generations_lost_requeue`` too, which publishes again a message a killed worker took off its
list and lost before recording it (``inference/pending.py``).

Outcomes. ``requests``: what the clients sent; ``ok``: searches answered 200, answers whose
stream ended with the answer, uploads answered 201; ``failed``: the rest, each with its
reason in ``failures`` (a connection cut by the web kill, an answer that ended in an error:
the client was told). After the load, the run waits up to ``--drain-seconds`` for the work
the system accepted: ``lost`` counts what it accepted and never finished (an upload answered
201 whose document is not indexed, an answer answered 202 that has no ledger row or never
ended), and ``duplicate_ledger_rows`` the ledger rows beyond one per request (the table's
unique ``request_id`` holds that; it is checked all the same); ``chunks_duplicated`` the chunks
beyond each indexed document's own count. ``unacknowledged``: documents and answers stored
whose client was not told (a kill cut the response), and those of them left half done
(``unfinished``: each must be done whole or not stored). ``latency_ms``: p50 and p99 of ok
requests per kind (an answer: from the POST to its last event).

Database and Redis: a database of its own, ``ragsite_bench_scale_out``, on the project's
PostgreSQL (dropped after unless ``--keep``), and Redis database 8 of the project's server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from benchmarks.common import (
    CRANFIELD,
    Process,
    multipart_form,
    own_databases,
    percentile,
    report,
    sse_events,
    system_start,
)

DATABASE = "ragsite_bench_scale_out"
REDIS_DB = 8
KINDS = ("search", "answer", "upload")
WEIGHTS = (6, 3, 1)
# The redelivery of a killed worker's task within the run (see the module docstring).
QUICK_REDELIVERY = {
    "CELERY_TASK_SOFT_TIME_LIMIT": "15",
    "CELERY_TASK_TIME_LIMIT": "18",
    "CELERY_VISIBILITY_TIMEOUT": "20",
    # Ledger rows a killed drainer had read and not stored are taken over after this (60 s by default).
    "LEDGER_CLAIM_IDLE_S": "5",
}
RESTARTED = "-again"  # the name of a killed worker's restart: its own, then this
WORKERS = {
    "ingest-a": ["-Q", "ingest,default", "-c", "1"],
    "ingest-b": ["-Q", "ingest,default", "-c", "1"],
    "remote-a": ["-Q", "remote", "--pool", "threads", "-c", "8"],
    "remote-b": ["-Q", "remote", "--pool", "threads", "-c", "8"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="How long the clients send.")
    parser.add_argument("--clients", type=int, default=8, help="Concurrent clients (closed loop, no think time).")
    parser.add_argument("--docs", type=int, default=40, help="Cranfield documents ingested first.")
    parser.add_argument("--drain-seconds", type=float, default=150.0, help="How long accepted work may take after.")
    parser.add_argument("--seed", type=int, default=41, help="The clients' choice of request kinds.")
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database afterwards.")
    args = parser.parse_args()
    if args.seconds <= 0 or args.clients < 1:
        parser.error("--seconds must be positive and --clients at least 1")

    from tests.pgbouncer import BINARY
    from tests.s3_server import S3Server
    from tests.upstream_server import serving

    if not os.path.exists(BINARY):
        raise SystemExit("pgbouncer is not installed: `apt-get install pgbouncer` (Debian), then run this again")
    with tempfile.TemporaryDirectory(prefix="bench-scale-out-") as folder, serving() as upstream:
        s3 = S3Server(Path(folder))
        try:
            os.environ.update(s3.env())  # this process's own ingestion of the corpus too
            with own_databases(DATABASE, REDIS_DB, keep=args.keep):
                result = run(args, upstream, s3, Path(folder))
        finally:
            s3.stop()
    report("scale_out", result, corpus=CRANFIELD)


def run(args, upstream: str, s3, folder: Path) -> dict:
    from django.conf import settings
    from django.db import connection, connections

    from benchmarks.load import corpus_setup, warm_up
    from billing import client_keys
    from search.models import Collection
    from tests.pgbouncer import PgBouncer

    setup = argparse.Namespace(docs=args.docs, keys=1, queries=30, max_tokens=24)
    _, queries = corpus_setup(setup, upstream)
    collection = Collection.objects.get(name="Cranfield")
    scopes = ["search", "generate", "documents"]
    tokens = [client_keys.client_key_create(collection.workspace, f"scale-out {n}", scopes=scopes)[1] for n in range(4)]
    params = connection.get_connection_params()
    direct = settings.DATABASES["default"]
    direct_url = os.environ["DATABASE_URL"]
    connections.close_all()
    bouncer = PgBouncer(params["host"], int(params.get("port") or 5432), replica_of=direct["NAME"])
    env = {
        "DATABASE_URL": bouncer.url(direct["NAME"]),
        "DATABASE_TRANSACTION_POOLING": "true",
        "DATABASE_DIRECT_URL": direct_url,
        **QUICK_REDELIVERY,
    }
    processes: list[Process] = []
    restarted: list[Process] = []
    try:
        base_url, processes = system_start(folder, workers=WORKERS, env=env, web_processes=2)
        # Untimed: both web processes load the embedder and every query's embedding is cached;
        # every query answered once (the workers' embedder, the passages' sentences cached).
        warm_up(base_url, tokens, queries, setup.max_tokens)
        load = Load(args, base_url, tokens, queries, collection.pk)
        kills = Kills(processes, folder, env, args.seconds)
        restarted = kills.restarted
        before = rows_now()
        transactions_before = bouncer.transactions(direct["NAME"])
        started = time.monotonic()
        kills.start(started)
        load.run(started)
        kills.join()
        accepted = load.accepted()
        created = {kind: sorted(ids - before[kind]) for kind, ids in rows_now().items()}
        drained_s = drain(created, args.drain_seconds)
        outcome = outcomes(load, accepted, created)
        # What the pooler carried for the run's work (the load, its ingestion, answers and ledger
        # rows, the drain's reads), per client request: the capacity model's PgBouncer input.
        transactions = bouncer.transactions(direct["NAME"]) - transactions_before
        dead = [process.name for process in kills.current(processes) if not process.alive()]
    finally:
        for process in processes + restarted:
            process.stop()
        bouncer.stop()
    return {
        **outcome,
        "kills": kills.done,
        "processes_dead_at_the_end": dead,
        "drained_s": drained_s,
        "pgbouncer_transactions_per_request": round(transactions / max(1, outcome["requests"]), 1),
        "seconds": args.seconds,
        "clients": args.clients,
        "docs": args.docs,
        "mix": dict(zip(KINDS, WEIGHTS, strict=True)),
        "visibility_timeout_s": int(QUICK_REDELIVERY["CELERY_VISIBILITY_TIMEOUT"]),
        "setup": "gunicorn with 2 uvicorn workers on one port; 2 ingest,default workers (prefork 1), 2 remote "
        "workers (threads 8); PostgreSQL behind PgBouncer (transaction mode); Redis; uploads on moto's S3 server; "
        "the OpenAI-protocol stand-in as the upstream",
    }


# --------------------------------------------------------------------------- the load


def call(method: str, url: str, token: str, body: bytes | None = None, content_type: str = "application/json"):
    """``(status, JSON body)``; status 0 with the reason when the connection failed."""
    headers = {"Authorization": f"Bearer {token}", **({"Content-Type": content_type} if body else {})}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)  # noqa: S310 (loopback)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")
    except (OSError, ValueError) as error:  # reset, refused, cut mid-body
        return 0, {"reason": f"{type(error).__name__}: {error}"}


# How long a client reads an answer's stream for its last event: the stream's keep-alive
# comments keep a socket's timeout from ever firing on an answer that never ends.
STREAM_DEADLINE_S = 90


def _before(lines, deadline: float):
    for line in lines:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no last event within {STREAM_DEADLINE_S} s")
        yield line


def stream_end(url: str, token: str, attempts: int = 5) -> tuple[str, str]:
    """The last event of an answer's stream, ``("answer" | "error", detail)``, read again from the
    last event seen when the connection is cut (``Last-Event-ID``); ``("cut", reason)`` when
    every attempt was, or none came within ``STREAM_DEADLINE_S``."""
    last_id, reason = None, ""
    deadline = time.monotonic() + STREAM_DEADLINE_S
    for _ in range(attempts):
        if time.monotonic() > deadline:
            break
        headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
        if last_id:
            headers["Last-Event-ID"] = last_id
        try:
            request = urllib.request.Request(url, headers=headers)  # noqa: S310 (loopback)
            with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
                for fields in sse_events(_before(response, deadline)):
                    last_id = fields.get("id") or last_id
                    if fields["event"] in ("answer", "error"):
                        return fields["event"], fields.get("data", "")[:300]
            reason = "the stream ended without its last event"
        except (OSError, ValueError) as error:
            reason = f"{type(error).__name__}: {error}"
        time.sleep(0.5)
    return "cut", reason


class Load:
    """The clients, what each request did, and what the system accepted."""

    def __init__(self, args, base_url: str, tokens: list[str], queries: list[str], collection_id: int):
        self.args, self.base_url, self.tokens, self.queries = args, base_url, tokens, queries
        self.collection_id = collection_id
        self.lock = threading.Lock()
        self.records: list[dict] = []  # kind, ok, ms, reason, and the accepted id

    def run(self, started: float) -> None:
        threads = [
            threading.Thread(target=self.client, args=(n, started), name=f"client-{n}")
            for n in range(self.args.clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def client(self, number: int, started: float) -> None:
        choose = random.Random(self.args.seed * 1000 + number)  # noqa: S311 (a load mix, not a secret)
        token = self.tokens[number % len(self.tokens)]
        sent = 0
        while time.monotonic() - started < self.args.seconds:
            kind = choose.choices(KINDS, WEIGHTS)[0]
            began = time.monotonic()
            record = getattr(self, kind)(token, number, sent, choose)
            record.update(kind=kind, ms=(time.monotonic() - began) * 1000)
            with self.lock:
                self.records.append(record)
            sent += 1

    def search(self, token: str, number: int, sent: int, choose: random.Random) -> dict:
        body = json.dumps({"query": choose.choice(self.queries), "mode": "hybrid", "top_k": 10}).encode()
        status, found = call("POST", f"{self.base_url}/api/v1/search", token, body)
        return {"ok": status == 200, "reason": "" if status == 200 else _reason(status, found)}

    def answer(self, token: str, number: int, sent: int, choose: random.Random) -> dict:
        body = json.dumps({"question": choose.choice(self.queries)}).encode()
        status, created = call("POST", f"{self.base_url}/api/v1/answers", token, body)
        if status != 202:
            return {"ok": False, "reason": _reason(status, created)}
        if created["status"] != "generating":  # answered at once (extractive): nothing in flight
            return {"ok": created["status"] == "done", "reason": created["status"], "answer": created["id"]}
        end, detail = stream_end(created["stream_url"], token)
        return {"ok": end == "answer", "reason": "" if end == "answer" else f"{end}: {detail}", "answer": created["id"]}

    def upload(self, token: str, number: int, sent: int, choose: random.Random) -> dict:
        name = f"note-{number}-{sent}-{uuid.uuid4().hex[:6]}.md"
        text = f"# Note {number}.{sent}\n\n" + " ".join(choose.choice(self.queries) for _ in range(12))
        body, content_type = multipart_form({"collection": str(self.collection_id)}, {name: text.encode()})
        status, uploaded = call("POST", f"{self.base_url}/api/v1/documents", token, body, content_type)
        if status != 201:
            return {"ok": False, "reason": _reason(status, uploaded), "upload_name": name}
        return {"ok": True, "reason": "", "document": uploaded["documents"][0]["id"], "upload_name": name}

    def accepted(self) -> dict[str, list]:
        """What the system took on: the answers it accepted, the documents it stored."""
        return {
            "answers": [record["answer"] for record in self.records if "answer" in record],
            "documents": [record["document"] for record in self.records if "document" in record],
        }


def _reason(status: int, body) -> str:
    if status == 0:
        return body["reason"][:200]
    error = body.get("error") if isinstance(body, dict) else None
    detail = error.get("code") or error.get("message") if isinstance(error, dict) else str(body)[:200]
    return f"HTTP {status}: {detail}"


# --------------------------------------------------------------------------- the kills


class Kills:
    """At set moments of the run: one gunicorn worker, then one worker of each queue killed
    whole and started again 2 s later (see the module docstring)."""

    def __init__(self, processes: list[Process], folder: Path, env: dict, seconds: float):
        self.processes, self.folder, self.env, self.seconds = processes, folder, env, seconds
        self.done: list[dict] = []
        self.restarted: list[Process] = []
        self.thread: threading.Thread | None = None

    def start(self, started: float) -> None:
        self.thread = threading.Thread(target=self._run, args=(started,), name="kills", daemon=True)
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def current(self, processes: list[Process]) -> list[Process]:
        """``processes`` with those killed replaced by their restarts."""
        replaced = {process.name.removesuffix(RESTARTED) for process in self.restarted}
        return [process for process in processes if process.name not in replaced] + self.restarted

    def _run(self, started: float) -> None:
        import psutil

        plan = [(0.30, "web"), (0.45, "ingest-a"), (0.60, "remote-a")]
        for share, name in plan:
            time.sleep(max(0.0, started + share * self.seconds - time.monotonic()))
            at = round(time.monotonic() - started, 1)
            process = next(process for process in self.processes if process.name == name)
            if name == "web":  # one of gunicorn's workers: the master starts another
                worker = psutil.Process(process.process.pid).children()[0]
                worker.send_signal(signal.SIGKILL)
                self.done.append({"what": "a web process (gunicorn worker), SIGKILL", "pid": worker.pid, "at_s": at})
                continue
            os.killpg(process.process.pid, signal.SIGKILL)
            process.process.wait()
            self.done.append({"what": f"worker {name}, its process group, SIGKILL", "at_s": at})
            time.sleep(2)
            self.restarted.append(_worker_again(process, self.folder, self.env))


def _worker_again(process: Process, folder: Path, env: dict) -> Process:
    """The same worker (its command, its node name), started again."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", RAGSITE_ENV="development", **env)
    return Process(f"{process.name}{RESTARTED}", list(process.process.args), full_env, folder)


# --------------------------------------------------------------------------- afterwards


def rows_now() -> dict[str, set]:
    """The ids of every document and answer stored so far."""
    from search.models import Answer, Document

    return {
        "documents": set(Document.objects.values_list("pk", flat=True)),
        "answers": {str(pk) for pk in Answer.objects.values_list("pk", flat=True)},
    }


def drain(created: dict[str, list], seconds: float) -> float:
    """Wait until every document stored during the load is indexed or failed and every answer
    has ended with its ledger row (those the clients were told of and those whose response a
    kill cut), or ``seconds`` pass; returns how long it took."""
    from billing import ledger
    from billing.models import UsageRecord
    from inference.tasks import generations_lost_requeue
    from search.models import Answer, Document

    began = time.monotonic()
    while time.monotonic() - began < seconds:
        # As beat's ledger_drain does (no beat runs here): rows a killed drainer left are claimed.
        ledger.usage_records_store(claim_idle_ms=int(float(QUICK_REDELIVERY["LEDGER_CLAIM_IDLE_S"]) * 1000))
        # As beat's generations-lost-requeue does: a message a killed worker took and lost is published again.
        generations_lost_requeue()
        documents = Document.objects.filter(pk__in=created["documents"]).exclude(status__in=("indexed", "failed"))
        answers = Answer.objects.filter(pk__in=created["answers"])
        open_answers = answers.exclude(status__in=("done", "failed")).count()
        billed = UsageRecord.objects.filter(request_id__in=created["answers"]).count()
        if not documents.exists() and not open_answers and billed >= len(created["answers"]):
            break
        time.sleep(1)
    return round(time.monotonic() - began, 1)


def unfinished(documents: list[int], answers: list[str]) -> tuple[list[dict], list[str]]:
    """Of these, the documents not indexed (with their status, and the reason of one that failed)
    and the answers that never ended or have no ledger row."""
    from billing.models import UsageRecord
    from search.models import Answer, Document

    stored = {
        pk: (status, error)
        for pk, status, error in Document.objects.filter(pk__in=documents).values_list("pk", "status", "error")
    }
    documents_left = [
        {"id": pk, "status": stored[pk][0], "error": stored[pk][1]} if pk in stored else {"id": pk, "status": "absent"}
        for pk in documents
        if pk not in stored or stored[pk][0] != "indexed"
    ]
    billed = {str(pk) for pk in UsageRecord.objects.filter(request_id__in=answers).values_list("request_id", flat=True)}
    ended = {
        str(pk)
        for pk in Answer.objects.filter(pk__in=answers, status__in=("done", "failed")).values_list("pk", flat=True)
    }
    return documents_left, [pk for pk in answers if pk not in ended or pk not in billed]


def outcomes(load: Load, accepted: dict[str, list], created: dict[str, list]) -> dict:
    from django.db.models import Count

    from billing.models import UsageRecord
    from search.models import Chunk, Document

    records = load.records
    lost_uploads, lost_answers = unfinished(accepted["documents"], accepted["answers"])
    # Stored, but their clients were not told (a kill cut the response): done whole or not at all.
    half_documents, half_answers = unfinished(
        sorted(set(created["documents"]) - set(accepted["documents"])),
        sorted(set(created["answers"]) - set(accepted["answers"])),
    )
    documents = Document.objects.filter(pk__in=created["documents"], status="indexed")
    chunks = dict(
        Chunk.objects.filter(document_id__in=created["documents"])
        .values_list("document_id")
        .annotate(n=Count("id"))
        .values_list("document_id", "n")
    )
    chunks_duplicated = sum(max(0, chunks.get(document.pk, 0) - document.chunks_total) for document in documents)
    duplicates = sum(
        count - 1
        for count in UsageRecord.objects.values_list("request_id").annotate(n=Count("id")).values_list("n", flat=True)
        if count > 1
    )
    failures: dict[str, int] = {}
    for record in records:
        if not record["ok"]:
            key = f"{record['kind']}: {record['reason'][:120]}"
            failures[key] = failures.get(key, 0) + 1
    by_kind = {}
    for kind in KINDS:
        mine = [record for record in records if record["kind"] == kind]
        ok_ms = [record["ms"] for record in mine if record["ok"]]
        by_kind[kind] = {
            "requests": len(mine),
            "ok": len(ok_ms),
            "failed": len(mine) - len(ok_ms),
            "p50_ms": percentile(ok_ms, 50, 1),
            "p99_ms": percentile(ok_ms, 99, 1),
        }
    ok = sum(1 for record in records if record["ok"])
    return {
        "requests": len(records),
        "ok": ok,
        "failed": len(records) - ok,
        "lost": len(lost_uploads) + len(lost_answers),
        "duplicate_ledger_rows": duplicates,
        "chunks_duplicated": chunks_duplicated,
        "lost_uploads": lost_uploads,
        "lost_answers": lost_answers,
        "unacknowledged": {
            "documents": len(created["documents"]) - len(accepted["documents"]),
            "answers": len(created["answers"]) - len(accepted["answers"]),
            "unfinished": half_documents + half_answers,
        },
        "latency_ms": {kind: {"p50": by_kind[kind]["p50_ms"], "p99": by_kind[kind]["p99_ms"]} for kind in KINDS},
        "by_kind": by_kind,
        "failures": failures,
        "ok_rps": round(ok / load.args.seconds, 2),
    }


if __name__ == "__main__":
    main()
