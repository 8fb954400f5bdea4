"""Load: rising concurrency against the real system on loopback, until it sheds or fails.

    python -m benchmarks.load [--scenarios search,answers] [--levels 1,2,4,8,16,32,64]
                              [--level-seconds 10] [--docs 200] [--keep]

What runs. The system as ``manage.py up`` runs it, each part its own process on 127.0.0.1:
the web process (uvicorn, ASGI), a worker on ``ingest,default`` (2 processes: storing
answers, the ledger), a ``remote`` worker (threads pool, ``--remote-concurrency``), and the
OpenAI-protocol stand-in of the tests (``tests/upstream_server.py``) as the upstream of the
default route. No beat (its jobs are periodic housekeeping, not on a request's path).
``--docs`` Cranfield documents are ingested first (in this process, untimed) into one
collection; the queries are the first ``--queries`` of Cranfield's, in turn, each embedded
once during the warm-up so that every level meets the query-embedding cache alike; each query is answered
once too, so that every level meets the workers' embedder loaded and the passages' sentences embedded.

Database connections. The web process pools its connections (``DATABASE_POOL=auto``: on
under ASGI, ragsite/settings.py). Without the pool (``--database-pool off``), Django runs
each synchronous view of an ASGI request in a thread of its own and each such thread's
persistent connection stays open after its request: at about 20 requests a second
PostgreSQL's 100 connections were gone within seconds ("FATAL: sorry, too many clients
already", errors from 16 users on). That is how this benchmark found the leak.

Scenarios. ``search``: ``POST /api/v1/search`` (hybrid, top 10): authentication, the
query's embedding (cached after its first use), one SQL statement. ``answers``: ``POST
/v1/chat/completions``, not streamed: retrieval, the prompt, admission against the key's
limits, the queue, the remote worker's routed call to the stand-in, the answer's Redis
stream read back by the web process, the stored answer. The stand-in answers at once
(``You said: ...``, a dozen tokens), so the figures are our system's costs, not a model's.

Load. locust (``benchmarks/locustfile.py``), headless, in a process of its own: closed-loop
users with no think time (after a 429/503 a user waits what ``retry-after-ms``, else
``Retry-After``, asks, as the OpenAI SDKs do; ``--ignore-retry-after``: at once), each level
held ``--level-seconds``; a level counts the responses that came in it, except in its first
``--settle-seconds`` (users joining, the previous level's tail). A client gives up on a
request after ``--timeout`` seconds. Every request uses the next of ``--keys`` client keys
(no limits of their own; searches are throttled at 600 a minute per key by the API, so the
keys together allow ``--keys`` x 10 searches a second, above what this machine serves): the
keys are not the bottleneck.

Outcomes. ``ok``: 2xx. ``shed``: 429 or 503 with ``Retry-After``, the service saying "not
now" (``ragsite/overload.py``: ``WEB_MAX_IN_FLIGHT`` requests in progress per web process;
``inference/backpressure.py``: ``GENERATION_QUEUE_MAX`` generations waiting per queue).
``error``: anything else, including a request the client gave up on (status 0). Per level:
``ok_rps``, ``p50_ms`` and ``p99_ms`` of ok responses, ``error_rate``, ``shed`` with
``status_429``/``status_503`` and the shed responses' own ``shed_p50_ms``/``shed_p99_ms``
(how quickly the service says no), and for answers ``max_queue_depth`` (the ``remote``
list's length, sampled every 0.2 s), and each part's CPU: ``cores`` (CPU seconds per second)
and ``cpu_ms_per_ok`` (CPU milliseconds per ok response) of the web process, each worker (with
its pool's processes), PostgreSQL and Redis (where they run on this machine) and the load
generator itself (locust: on one machine it takes its share of the cores); ``cpu_ms_per_ok_at_peak``
is the peak level's, per scenario (docs/scaling.md's capacity model reads it).
``max_zero_error_concurrency``: the highest level
with neither errors nor shed responses (shedding is the service protecting itself, not
serving: a level that sheds is beyond capacity). ``max_concurrency_without_errors``: the
highest level with no errors, shed responses allowed (shedding works instead of timing out).

Database and Redis: a database of its own, ``ragsite_bench_load``, on the project's
PostgreSQL (dropped after unless ``--keep``), and Redis database 13 of the project's
server, emptied first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from benchmarks.common import (
    CRANFIELD,
    ROOT,
    Process,
    own_databases,
    percentile,
    report,
    service_pids,
    system_start,
    tree_cpu_s,
)

DATABASE = "ragsite_bench_load"
REDIS_DB = 13
QUEUE = "remote"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="search,answers", help="Comma-separated: search, answers.")
    parser.add_argument("--levels", default="1,2,4,8,16,32,64,128", help="Concurrent users at each step.")
    parser.add_argument("--level-seconds", type=float, default=10.0, help="How long each level is held.")
    parser.add_argument("--settle-seconds", type=float, default=1.0, help="Not counted at the start of a level.")
    parser.add_argument("--timeout", type=float, default=30.0, help="A client gives up on a request after this.")
    parser.add_argument("--docs", type=int, default=200, help="Cranfield documents ingested first.")
    parser.add_argument("--keys", type=int, default=50, help="Client keys the requests take in turn.")
    parser.add_argument("--queries", type=int, default=50, help="Cranfield queries asked in turn (warmed up first).")
    parser.add_argument(
        "--database-pool",
        choices=("auto", "on", "off"),
        default="auto",
        help="DATABASE_POOL of the web process (off: persistent connections per request thread, the leak).",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each answer.")
    parser.add_argument("--remote-concurrency", type=int, default=16, help="Threads of the remote worker.")
    parser.add_argument(
        "--web-max-in-flight", type=int, default=None, help="WEB_MAX_IN_FLIGHT of the web process (0: no bound)."
    )
    parser.add_argument(
        "--queue-max", type=int, default=None, help="GENERATION_QUEUE_MAX of the web process (0: no bound)."
    )
    parser.add_argument(
        "--ignore-retry-after", action="store_true", help="Users retry at once after a 429/503 (a careless client)."
    )
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database afterwards.")
    args = parser.parse_args()
    args.scenarios = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    args.levels = [int(level) for level in args.levels.split(",")]
    if not set(args.scenarios) <= {"search", "answers"} or not args.levels or min(args.levels) < 1:
        parser.error("scenarios are search and answers; levels are positive integers")

    from tests.upstream_server import serving

    with (
        own_databases(DATABASE, REDIS_DB, keep=args.keep),
        serving() as upstream,
        tempfile.TemporaryDirectory(prefix="bench-load-") as folder,
    ):
        result = run(args, upstream, Path(folder))
    report("load", result, corpus=CRANFIELD)


# --------------------------------------------------------------------------- set-up


def corpus_setup(args, upstream: str) -> tuple[list[str], list[str]]:
    """The collection, ingested; the route on the stand-in; the client keys. Returns (tokens, queries)."""
    from billing import client_keys
    from inference.models import Provider, Route, UpstreamKey
    from search.beir import corpus_read
    from search.ingest import pipeline
    from search.services import collection_create, document_create, workspace_create

    workspace = workspace_create(name="Load", slug="load")
    collection = collection_create(workspace=workspace, name="Cranfield")
    ids = []
    for document in corpus_read(CRANFIELD):
        if len(ids) >= args.docs:
            break
        if document.content():
            content = document.content().encode()
            ids.append(document_create(collection=collection, source_name=f"{document.id}.txt", content=content,
                                       enqueue=False)[0].pk)  # fmt: skip
    pipeline.documents_ingest(document_ids=ids)

    provider = Provider.objects.create(
        name="stand-in", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=upstream, model="stand-in-7b",
        context_window=8192, first_token_timeout_s=30, total_timeout_s=60,
    )  # fmt: skip
    for label in ("a", "b", "c", "d"):
        key = UpstreamKey(provider=provider, label=label)
        key.set_secret(f"sk-load-{label}-{uuid.uuid4().hex}")
        key.save()
    # Answers are generated whatever their passages say: the load is the generations'.
    Route.objects.create(name="default", provider=provider, is_default=True, max_tokens=args.max_tokens, abstains=False)
    tokens = [
        client_keys.client_key_create(workspace, f"load {n}", scopes=["search", "generate"])[1]
        for n in range(args.keys)
    ]
    with open(CRANFIELD / "queries.jsonl") as handle:
        queries = [json.loads(line)["text"] for line in handle if line.strip()][: args.queries]
    return tokens, queries


def start_system(args, folder: Path) -> tuple[str, list[Process]]:
    """The web process and the workers, as ``manage.py up`` runs them; returns the base URL once
    /healthz answers and both workers answer a ping."""
    env = {}
    if args.web_max_in_flight is not None:
        env["WEB_MAX_IN_FLIGHT"] = str(args.web_max_in_flight)
    if args.queue_max is not None:
        env["GENERATION_QUEUE_MAX"] = str(args.queue_max)
    return system_start(
        folder,
        env=env,
        web_env={"DATABASE_POOL": args.database_pool},
        workers={
            "ingest": ["-Q", "ingest,default", "-c", "2"],
            QUEUE: ["-Q", QUEUE, "--pool", "threads", "-c", str(args.remote_concurrency)],
        },
    )


def post(url: str, token: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(  # noqa: S310 (our own http URL on loopback)
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def warm_up(base_url: str, tokens: list[str], queries: list[str], max_tokens: int) -> None:
    """The web process loads the embedder and embeds every query once (its cache then serves
    them, at every level alike); every query answered once end to end, which loads the
    workers' embedder and caches the embeddings of the passages' sentences the citation
    check compares (``search.embedders.passage_embeddings``), again for every level alike."""
    from concurrent.futures import ThreadPoolExecutor

    def search(query: str) -> None:
        status, body = post(f"{base_url}/api/v1/search", tokens[0], {"query": query, "top_k": 10})
        if status != 200:
            raise SystemExit(f"warm-up search failed: {status} {body}")

    search(queries[0])
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(search, queries))

    def answer(query: str) -> None:
        chat = {"model": "default", "messages": [{"role": "user", "content": query}], "max_tokens": max_tokens}
        status, body = post(f"{base_url}/v1/chat/completions", tokens[0], chat)
        if status != 200 or not body["choices"][0]["message"]["content"]:
            raise SystemExit(f"warm-up answer failed: {status} {body}")

    answer(queries[0])
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(answer, queries))


# --------------------------------------------------------------------------- the runs


def sample_queue(stop: threading.Event, samples: list[tuple[float, int, dict]], parts: dict[str, int]) -> None:
    """Every 0.2 s: the time, the queue's depth and the CPU seconds each part has used so far."""
    from ragsite.celery import queue_depth
    from ragsite.redis import Role, redis_client

    client = redis_client(Role.BROKER)
    while not stop.wait(0.2):
        samples.append(
            (time.time(), queue_depth(QUEUE, client), {name: tree_cpu_s(pid) for name, pid in parts.items()})
        )


def drain(seconds: float = 120) -> None:
    """Wait until the queue is empty and no answer is generating, so the next run starts clean."""
    from ragsite.celery import queue_depth
    from search.models import Answer

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if queue_depth(QUEUE) == 0 and not Answer.objects.filter(status=Answer.Status.GENERATING).exists():
            return
        time.sleep(0.5)
    print(f"warning: the system had not drained after {seconds:g} s", file=sys.stderr, flush=True)


def run_scenario(args, scenario: str, base_url: str, tokens, queries, folder: Path, parts: dict) -> list[dict]:
    out = folder / f"{scenario}.json"
    config = {
        "scenario": scenario,
        "levels": args.levels,
        "level_s": args.level_seconds,
        "tokens": tokens,
        "queries": queries,
        "model": "default",
        "max_tokens": args.max_tokens,
        "timeout_s": args.timeout,
        "honor_retry_after": not args.ignore_retry_after,
        "out": str(out),
    }
    env = dict(os.environ, LOAD_CONFIG=json.dumps(config), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "locust", "-f", str(ROOT / "benchmarks" / "locustfile.py"), "--headless",
               "--host", base_url, "--only-summary", "--loglevel", "WARNING", "--exit-code-on-error", "0"]  # fmt: skip
    samples: list[tuple[float, int, dict]] = []
    stop = threading.Event()
    started = time.time()
    limit = len(args.levels) * args.level_seconds + args.timeout + 60
    locust = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The load generator's CPU too: on one machine it takes its share of the cores it measures.
    sampler = threading.Thread(
        target=sample_queue, args=(stop, samples, {**parts, "load_generator": locust.pid}), daemon=True
    )
    sampler.start()
    try:
        stdout, stderr = locust.communicate(timeout=limit)
    finally:
        if locust.poll() is None:
            locust.kill()
        stop.set()
        sampler.join()
    if locust.returncode != 0 or not out.exists():
        raise SystemExit(f"locust failed ({locust.returncode}):\n{stdout[-3000:]}{stderr[-3000:]}")
    records = json.loads(out.read_text())
    # The shape's clock starts with the test, a moment after the process: take the first request's start.
    origin = min((record[0] for record in records), default=started)
    levels = summarise(args, records, origin, samples)
    for level in levels:
        print(
            f"{scenario:8} users {level['users']:3}: {level['ok_rps']:7.1f} ok/s  p50 {level['p50_ms']} ms  "
            f"p99 {level['p99_ms']} ms  errors {level['error_rate']:.3f}  shed 429/503 "
            f"{level['status_429']}/{level['status_503']} (p50 {level['shed_p50_ms']} ms)"
            + (f"  queue max {level['max_queue_depth']}" if scenario == "answers" else ""),
            flush=True,
        )
    return levels


def outcome(record: list) -> str:
    """ok (2xx), shed (429 or 503 with Retry-After) or error (anything else; 0: no response)."""
    status, retry_after = record[2], record[3]
    if 200 <= status < 300:
        return "ok"
    return "shed" if status in (429, 503) and retry_after else "error"


def summarise(args, records: list[list], origin: float, samples: list[tuple[float, int]]) -> list[dict]:
    window = args.level_seconds - args.settle_seconds
    levels = []
    for index, users in enumerate(args.levels):
        begin = origin + index * args.level_seconds
        # By when the response came: what the system delivered in the level. Counted by when the
        # request started, a level was credited with the work its queue carried into the next
        # one (a queue bounded by time grows by a second's work or so as a level begins).
        counted = [r for r in records if begin + args.settle_seconds <= r[0] + r[1] / 1000 < begin + args.level_seconds]
        kinds = [outcome(r) for r in counted]
        ok = [r[1] for r, kind in zip(counted, kinds, strict=True) if kind == "ok"]
        shed = [r for r, kind in zip(counted, kinds, strict=True) if kind == "shed"]
        errors = kinds.count("error")
        statuses: dict[str, int] = {}
        for record in counted:
            statuses[str(record[2])] = statuses.get(str(record[2]), 0) + 1
        depths = [depth for moment, depth, _ in samples if begin <= moment < begin + args.level_seconds]
        levels.append({
            "users": users,
            "requests": len(counted),
            "ok_rps": round(len(ok) / window, 1),
            "p50_ms": percentile(ok, 50, 1),
            "p99_ms": percentile(ok, 99, 1),
            "errors": errors,
            "error_rate": round(errors / len(counted), 4) if counted else 0.0,
            "shed": len(shed),
            "status_429": sum(r[2] == 429 for r in shed),
            "status_503": sum(r[2] == 503 for r in shed),
            "shed_p50_ms": percentile([r[1] for r in shed], 50, 1),
            "shed_p99_ms": percentile([r[1] for r in shed], 99, 1),
            "statuses": statuses,
            "max_queue_depth": max(depths, default=0),
            **cpu_of_parts(samples, begin + args.settle_seconds, begin + args.level_seconds, len(ok)),
        })  # fmt: skip
    return levels


def cpu_of_parts(samples: list[tuple[float, int, dict]], start: float, end: float, ok: int) -> dict:
    """Each part's CPU over [start, end) from the samples nearest inside it: ``cores`` (CPU
    seconds per second) and ``cpu_ms_per_ok`` (CPU milliseconds per ok response)."""
    inside = [(moment, cpu) for moment, _, cpu in samples if start <= moment < end]
    if len(inside) < 2:
        return {"cores": {}, "cpu_ms_per_ok": {}}
    (first_at, first), (last_at, last) = inside[0], inside[-1]
    used = {name: last[name] - first[name] for name in first if first[name] is not None and last.get(name) is not None}
    seconds = last_at - first_at
    share = seconds / (end - start)  # the ok responses of the sampled span, in proportion
    return {
        "cores": {name: round(value / seconds, 3) for name, value in used.items()},
        "cpu_ms_per_ok": {name: round(value * 1000 / (ok * share), 2) for name, value in used.items()} if ok else {},
    }


def run(args, upstream: str, folder: Path) -> dict:
    from django.conf import settings
    from django.db import connections

    setup_started = time.perf_counter()
    tokens, queries = corpus_setup(args, upstream)
    connections.close_all()
    base_url, processes = start_system(args, folder)
    # Whose CPU each level's figures split: each process of ours (with its pool's processes) and,
    # where they run on this machine, PostgreSQL's and Redis's.
    parts = {process.name: process.process.pid for process in processes} | service_pids()
    scenarios = {}
    try:
        warm_up(base_url, tokens, queries, args.max_tokens)
        setup_s = round(time.perf_counter() - setup_started, 1)
        for scenario in args.scenarios:
            levels = run_scenario(args, scenario, base_url, tokens, queries, folder, parts)
            drain()
            clean = [level["users"] for level in levels if level["errors"] == 0 and level["shed"] == 0]
            no_errors = [level["users"] for level in levels if level["errors"] == 0]
            scenarios[scenario] = {
                "levels": levels,
                "max_zero_error_concurrency": max(clean, default=0),
                "max_concurrency_without_errors": max(no_errors, default=0),
                "peak_ok_rps": max(level["ok_rps"] for level in levels),
                # What one ok response cost each part at the peak: the capacity model's inputs.
                "cpu_ms_per_ok_at_peak": max(levels, key=lambda level: level["ok_rps"])["cpu_ms_per_ok"],
            }
        for process in processes:
            if not process.alive():
                raise SystemExit(f"{process.name} died during the run:\n{process.log_tail()}")
    finally:
        for process in processes:
            process.stop()
    return {
        "max_zero_error_concurrency": {name: s["max_zero_error_concurrency"] for name, s in scenarios.items()},
        "max_concurrency_without_errors": {name: s["max_concurrency_without_errors"] for name, s in scenarios.items()},
        "peak_ok_rps": {name: s["peak_ok_rps"] for name, s in scenarios.items()},
        "cpu_ms_per_ok_at_peak": {name: s["cpu_ms_per_ok_at_peak"] for name, s in scenarios.items()},
        "scenarios": scenarios,
        "level_seconds": args.level_seconds,
        "settle_seconds": args.settle_seconds,
        "timeout_s": args.timeout,
        "honor_retry_after": not args.ignore_retry_after,
        "docs": args.docs,
        "queries": len(queries),
        "database_pool": args.database_pool,
        "web_max_in_flight": args.web_max_in_flight
        if args.web_max_in_flight is not None
        else settings.WEB_MAX_IN_FLIGHT,
        "generation_queue_max": args.queue_max if args.queue_max is not None else settings.GENERATION_QUEUE_MAX,
        "remote_concurrency": args.remote_concurrency,
        "setup_s": setup_s,
        "method": "closed-loop locust users, no think time; shed = 429/503 with Retry-After; "
        "max_zero_error_concurrency: highest level with neither errors nor shed responses",
    }


if __name__ == "__main__":
    main()
