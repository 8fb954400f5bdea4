"""The gateway's price: streamed chat completions through our OpenAI-compatible ``/v1`` and
the same completions from the same upstream called directly, in one run: one at a time
(paired), then at held concurrency levels.

    python -m benchmarks.gateway_overhead [--requests 200] [--warmup 20] [--tokens 16]
        [--levels 1,8,32,100] [--level-seconds 15] [--token-delay-ms 100] [--keep]

What runs. The system as ``manage.py up`` runs it, each part its own process on 127.0.0.1:
the web process (uvicorn, ASGI), a ``remote`` worker (threads pool, one thread per stream of
the highest level, as an operator serving that many sets ``REMOTE_WORKER_CONCURRENCY``) and
the ``ingest,default`` worker (two processes: they store each answer and its ledger row once
its stream has ended, off the client's path). The upstream is the OpenAI-protocol stand-in of
the tests (``tests/upstream_server.py``): every request's last user message ends with
``REPLY: <--tokens words>`` and the stand-in streams exactly those words, one chunk each, so
the two sides stream the same text (checked for every request).

Direct. The official ``openai`` client (retries off) calling the stand-in. Gateway. The same
call with the same client library, ``base_url`` our ``/v1`` and a client key with a monthly
budget (the stand-in's model is priced, so each request reserves and settles real money):
authentication, admission against the key's budget, the route's plan, the prompt, the answer's
row, the message on queue ``remote``, the worker's routed call to the stand-in streamed into
Redis, the web process relaying the stream as Server-Sent Events, the ledger row. The key's
workspace has no collection, so there is nothing to retrieve: retrieval's own cost is
``benchmarks.search_scale``'s and the load benchmark's, not the gateway's.

One at a time (the headline). The stand-in answers at once. ``ttft``: from the call until the
first chunk with content; ``total``: until the stream's end. Requests run in pairs (direct,
gateway), the order alternating from one pair to the next, after an untimed warm-up of each:
the machine's drift falls on both alike. ``overhead_ttft_p50_ms``/``p99``: percentiles of the
per-pair differences (gateway minus direct); ``overhead_total_p50_ms`` likewise.

Where the time goes (medians over the paired gateway requests, from each answer's own record):
``request_to_answer_ms`` (the answer's ``request_ms``), from the request reaching the
middleware to the answer's start (its ``created_at``): authentication, the body, the route's
plan; ``answer_to_submit_ms`` (``submit_ms``): retrieval, the prompt, the answer's row;
``submit_to_worker_ms`` (``queue_ms``): admission, the message on the queue, the broker hop,
the worker's pickup; ``worker_ttft_ms``: the attempt's own time to its first token from the
stand-in (the worker's HTTP call); ``http_and_relay_ms``, the client's TTFT minus
``request_ms`` minus the answer's ``ttft_ms`` (from ``created_at`` to the first token in
Redis): the HTTP request up to the middleware (uvicorn, Django's handler) and the relay from
Redis to the client (the stream's read, the response's start, the first chunks).

Held concurrency (``levels``). Each level runs ``N`` clients (``AsyncOpenAI``, one event loop
in this process), each sending one streamed request after another for ``--level-seconds``,
first all direct, then all through the gateway, on a second route whose upstream key makes the
stand-in pace its stream (``--token-delay-ms`` before each token, as a model decodes: a
16-token answer takes 1.6 s at 100 ms), so that ``N`` is the number of streams held open at
once; they join over the first second, and one told to come back (429/503 with
``Retry-After``) waits that long, as the SDKs do. Per side: ``ttft_p50_ms``/``ttft_p99_ms`` of
the streams served, ``ok_rps`` (streams completed per second), ``shed`` (refusals with
``Retry-After``: the service protecting itself), ``errors`` (anything else); per level
``overhead_ttft_p50_ms``/``overhead_ttft_p99_ms`` (gateway's percentile minus direct's) and
``cpu_cores`` during the gateway side: the cores each part of the system used (``psutil``:
user and system time over the window), which says where the web tier or a worker tops out.

The ledger (``ledger``): after the runs, every gateway answer is waited for until stored;
exactly one generation ledger row per gateway request that streamed (counted, by request id),
none twice, and the key's budget exact: the sum of its rows' costs equals the spending its
budget counter holds (Redis), with no reservation left. The run fails otherwise.

A database of its own (``ragsite_bench_gateway``, dropped after unless ``--keep``) and Redis
database 10, emptied first.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from decimal import Decimal
from pathlib import Path

from benchmarks.common import logs_folder, own_databases, percentile, report, system_start

DATABASE = "ragsite_bench_gateway"
REDIS_DB = 10
WORDS = "Lift rises with the angle of attack until the wing stalls near fifteen degrees and then falls".split()
# The stand-in's model, priced: every gateway request reserves and settles money on the key's budget.
PRICE_USD_PER_MILLION = (Decimal("0.50"), Decimal("1.50"))
BUDGET_USD = Decimal("1000")
REQUEST_TIMEOUT_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="Measured pairs (direct, gateway), one at a time.")
    parser.add_argument("--warmup", type=int, default=20, help="Untimed requests of each side first.")
    parser.add_argument("--tokens", type=int, default=16, help="Words of every reply (one chunk each).")
    parser.add_argument(
        "--levels", default="1,8,32,100", help="Concurrent streams held, comma-separated ('' for none)."
    )
    parser.add_argument("--level-seconds", type=float, default=15.0, help="How long each side of a level runs.")
    parser.add_argument("--token-delay-ms", type=int, default=100, help="The paced stand-in's wait before each token.")
    parser.add_argument(
        "--keep", action="store_true", help=f"Keep the {DATABASE} database and the processes' logs afterwards."
    )
    args = parser.parse_args()
    try:
        args.levels = [int(level) for level in args.levels.split(",") if level.strip()]
    except ValueError:
        parser.error(f"--levels takes comma-separated integers, got {args.levels!r}")
    if args.requests < 1 or not 1 <= args.tokens <= len(WORDS):
        parser.error(f"--requests is at least 1; --tokens is from 1 to {len(WORDS)}")
    if any(level < 1 for level in args.levels) or args.level_seconds <= 0 or args.token_delay_ms < 0:
        parser.error("--levels are positive, --level-seconds is above 0, --token-delay-ms is at least 0")

    from tests.upstream_server import serving

    with (
        own_databases(DATABASE, REDIS_DB, keep=args.keep),
        serving() as upstream,
        logs_folder("bench-gateway-", keep=args.keep) as folder,
    ):
        result = run(args, upstream, Path(folder))
    report("gateway_overhead", result)


def _upstream_route(name: str, upstream: str, *, default: bool):
    """A provider on the stand-in with one upstream key, and its route; returns (route, key's secret)."""
    from inference.models import Provider, Route, UpstreamKey

    provider = Provider.objects.create(
        name=name, kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=upstream, model="stand-in-7b"
    )
    secret = f"sk-gateway-{uuid.uuid4().hex}"
    key = UpstreamKey(provider=provider, label="bench")
    key.set_secret(secret)
    key.save()
    # What is timed is the path to the upstream and back: every request generates (a workspace
    # without documents would otherwise decline at once, search.answering.abstention).
    route = Route.objects.create(
        name=name, provider=provider, is_default=default, max_tokens=64, temperature=0.0, abstains=False
    )
    return route, secret


def run(args, upstream: str, folder: Path) -> dict:
    import openai

    from billing import client_keys
    from billing.models import Price
    from search.services import workspace_create
    from tests.upstream_server import upstream_script

    workspace = workspace_create(name="Gateway", slug="gateway")
    Price.objects.create(
        model="stand-in-7b",
        input_usd_per_million=PRICE_USD_PER_MILLION[0],
        output_usd_per_million=PRICE_USD_PER_MILLION[1],
    )
    route, secret = _upstream_route("bench", upstream, default=True)
    paced_route, paced_secret = _upstream_route("bench-paced", upstream, default=False)
    upstream_script(upstream, paced_secret, [{"token_delay_ms": args.token_delay_ms, "repeat": True}])
    client_key, token = client_keys.client_key_create(
        workspace, "gateway", scopes=["generate"], monthly_budget_usd=BUDGET_USD
    )
    reply = " ".join(WORDS[: args.tokens])
    threads = max([8, *args.levels])

    direct_client = openai.OpenAI(base_url=upstream, api_key=secret, max_retries=0)
    base_url, processes = system_start(
        folder,
        workers={
            "remote": ["-Q", "remote", "--pool", "threads", "-c", str(threads)],
            "ingest": ["-Q", "ingest,default", "-c", "2"],
        },
    )
    try:
        gateway_client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0)
        paired = _paired(args, reply, {"direct": (direct_client, "stand-in-7b"), "gateway": (gateway_client, "bench")})
        levels = []
        for level in args.levels:
            sides = {
                "direct": (upstream, paced_secret, "stand-in-7b"),
                "gateway": (f"{base_url}/v1", token, paced_route.name),
            }
            levels.append(_level(args, reply, level, sides, processes))
        ledger = _ledger(
            client_key, expected=args.warmup + args.requests + sum(side["gateway_streams"] for side in levels)
        )
        breakdown = _breakdown(route, paired["gateway_ttfts"], args.warmup)
    finally:
        for process in processes:
            process.stop()
    return {
        **paired["figures"],
        "breakdown_p50_ms": breakdown,
        "levels": [{key: value for key, value in level.items() if key != "gateway_streams"} for level in levels],
        "ledger": ledger,
        "token_delay_ms": args.token_delay_ms,
    }


def _p(values: list[float], q: int) -> float | None:
    return round(percentile(values, q), 2) if values else None


def _paired(args, reply: str, sides: dict) -> dict:
    """One request at a time, direct and gateway in alternating pairs (see the module docstring)."""

    def call(client, model: str, number: int) -> tuple[float, float, str]:
        messages = [{"role": "user", "content": f"Request {number}.\nREPLY: {reply}"}]
        started = time.perf_counter()
        first, parts = None, []
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=64,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content:
                first = first if first is not None else time.perf_counter()
                parts.append(content)
        ended = time.perf_counter()
        if first is None:
            raise SystemExit(f"request {number} to {client.base_url} streamed no content")
        return (first - started) * 1000, (ended - started) * 1000, "".join(parts)

    for number in range(args.warmup):
        for client, model in sides.values():
            call(client, model, number)
    measured = {name: {"ttft": [], "total": []} for name in sides}
    for number in range(args.requests):
        order = list(sides) if number % 2 == 0 else list(reversed(sides))
        texts = {}
        for name in order:
            ttft, total, texts[name] = call(*sides[name], args.warmup + number)
            measured[name]["ttft"].append(ttft)
            measured[name]["total"].append(total)
        if texts["gateway"] != texts["direct"] or texts["direct"] != reply:
            raise SystemExit(f"pair {number} streamed different texts: {texts!r} (expected {reply!r})")

    direct, gateway = measured["direct"], measured["gateway"]
    figures = {"requests": args.requests, "reply_tokens": args.tokens}
    for part in ("ttft", "total"):
        overhead = [g - d for g, d in zip(gateway[part], direct[part], strict=True)]
        for side, values in (("direct", direct[part]), ("gateway", gateway[part]), ("overhead", overhead)):
            for q in (50, 99):
                figures[f"{side}_{part}_p{q}_ms"] = _p(values, q)
    return {"figures": figures, "gateway_ttfts": gateway["ttft"]}


# --------------------------------------------------------------------------- held concurrency


def _level(args, reply: str, concurrency: int, sides: dict, processes) -> dict:
    """``concurrency`` clients streaming one request after another, direct then gateway."""
    result = {"concurrency": concurrency}
    for name, (base_url, api_key, model) in sides.items():
        meter = _CpuMeter(processes)
        outcomes, elapsed = asyncio.run(_hold(base_url, api_key, model, reply, concurrency, args.level_seconds))
        cores = meter.cores()
        ttfts = [outcome[0] for outcome in outcomes if outcome[0] is not None]
        errors = [outcome[1] for outcome in outcomes if outcome[0] is None and outcome[1] != "shed"]
        result[name] = {
            "ttft_p50_ms": _p(ttfts, 50),
            "ttft_p99_ms": _p(ttfts, 99),
            "ok_rps": round(len(ttfts) / elapsed, 2),
            "shed": sum(1 for outcome in outcomes if outcome[1] == "shed"),
            "errors": len(errors),
            **({"error_kinds": sorted(set(errors))} if errors else {}),
        }
        if name == "gateway":
            result["cpu_cores"] = cores
            result["gateway_streams"] = sum(1 for outcome in outcomes if outcome[2])
            if errors:  # what the web process logged about them, for whoever reads the run
                web = next(process for process in processes if process.name == "web")
                print(
                    f"level {concurrency}: {len(errors)} gateway errors; the web log ends:\n{web.log_tail()}",
                    file=sys.stderr,
                )
    direct, gateway = result["direct"], result["gateway"]
    for q in (50, 99):
        d, g = direct[f"ttft_p{q}_ms"], gateway[f"ttft_p{q}_ms"]
        result[f"overhead_ttft_p{q}_ms"] = round(g - d, 2) if d is not None and g is not None else None
    return result


async def _hold(base_url: str, api_key: str, model: str, reply: str, concurrency: int, seconds: float):
    """Outcomes ``(ttft_ms or None, error kind, whether the gateway streamed)`` of every request
    started within ``seconds``, and the seconds until the last one ended. The clients join
    over the first second (a hundred requests in the same millisecond is no one's traffic);
    one told to come back (429/503 with ``Retry-After``) waits that long, as the SDKs do, and
    the refusal is counted as ``shed``."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S)
    outcomes: list[tuple[float | None, str, bool]] = []
    started = time.perf_counter()
    deadline = started + seconds

    async def user(number: int) -> None:
        await asyncio.sleep(number / concurrency)
        sent = 0
        while time.perf_counter() < deadline:
            sent += 1
            messages = [{"role": "user", "content": f"User {number}, request {sent}.\nREPLY: {reply}"}]
            began, first, parts, streamed = time.perf_counter(), None, [], False
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=64, temperature=0, stream=True
                )
                streamed = True
                async for chunk in stream:
                    content = chunk.choices[0].delta.content if chunk.choices else None
                    if content:
                        first = first if first is not None else time.perf_counter()
                        parts.append(content)
            except openai.APIStatusError as exc:
                retry_after = exc.response.headers.get("retry-after")
                if exc.status_code in (429, 503) and retry_after is not None:
                    outcomes.append((None, "shed", streamed))
                    await asyncio.sleep(float(retry_after))
                else:
                    outcomes.append((None, f"{type(exc).__name__} {exc.status_code}", streamed))
                continue
            except openai.APIError as exc:
                outcomes.append((None, type(exc).__name__, streamed))
                continue
            if first is None or "".join(parts) != reply:
                outcomes.append((None, "wrong_text", streamed))
            else:
                outcomes.append(((first - began) * 1000, "", streamed))

    try:
        await asyncio.gather(*(user(number) for number in range(concurrency)))
    finally:
        await client.close()
    return outcomes, time.perf_counter() - started


class _CpuMeter:
    """The cores each part of the system uses from now until ``cores()``: user plus system CPU
    time of its processes (with their children) over the wall time."""

    def __init__(self, processes):
        import psutil

        self.parts = {
            f"{process.name}_worker" if process.name != "web" else "web": process.process.pid for process in processes
        }
        self.psutil = psutil
        self.started = time.perf_counter()
        self.before = self._times(self._groups())

    def _groups(self) -> dict[str, list]:
        psutil = self.psutil
        groups: dict[str, list] = {}
        for name, pid in self.parts.items():
            try:
                parent = psutil.Process(pid)
                groups[name] = [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                groups[name] = []
        for process in psutil.process_iter(["name", "cmdline"]):
            command = " ".join(process.info["cmdline"] or [])
            if process.info["name"] == "redis-server":
                groups.setdefault("redis", []).append(process)
            elif (process.info["name"] or "").startswith("postgres"):
                groups.setdefault("postgres", []).append(process)
            elif "tests.upstream_server" in command:
                groups.setdefault("stand_in", []).append(process)
        groups["client"] = [psutil.Process()]
        return groups

    def _times(self, groups: dict[str, list]) -> dict[int, float]:
        times = {}
        for members in groups.values():
            for process in members:
                try:
                    cpu = process.cpu_times()
                    times[process.pid] = cpu.user + cpu.system
                except self.psutil.NoSuchProcess:
                    pass
        return times

    def cores(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.started
        groups = self._groups()
        after = self._times(groups)
        used = {}
        for name, members in groups.items():
            seconds = sum(after[p.pid] - self.before.get(p.pid, 0.0) for p in members if p.pid in after)
            used[name] = round(max(0.0, seconds) / elapsed, 2)
        return used


# --------------------------------------------------------------------------- the ledger


def _ledger(client_key, *, expected: int) -> dict:
    """Every gateway answer stored, exactly one ledger row each, the key's budget exact."""
    from django.db.models import Count, Sum

    from billing import limits
    from billing.models import UsageRecord
    from search.models import Answer

    deadline = time.monotonic() + 300  # the ingest worker stores the last answers after their streams ended
    unfinished = (Answer.Status.QUEUED, Answer.Status.GENERATING)
    while Answer.objects.filter(status__in=unfinished).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{Answer.objects.filter(status__in=unfinished).count()} answers still unfinished")
        time.sleep(0.5)
    rows = UsageRecord.objects.filter(kind=UsageRecord.Kind.GENERATION, client_key=client_key)
    answer_ids = {str(pk) for pk in Answer.objects.values_list("pk", flat=True)}
    row_ids = {str(pk) for pk in rows.values_list("request_id", flat=True)}
    duplicates = rows.values("request_id").annotate(n=Count("id")).filter(n__gt=1).count()
    cost = rows.aggregate(total=Sum("cost_usd"))["total"] or Decimal("0")
    budget = limits.budget_state(client_key)
    figures = {
        "gateway_requests": expected,
        "answers": len(answer_ids),
        "ledger_rows": rows.count(),
        "answers_without_a_row": len(answer_ids - row_ids),
        "rows_without_an_answer": len(row_ids - answer_ids),
        "duplicate_rows": duplicates,
        "rows_cost_usd": str(cost),
        "budget_spent_usd": str(budget.spent_usd),
        "budget_reserved_usd": str(budget.reserved_usd),
    }
    exact = (
        figures["ledger_rows"] == figures["answers"] == expected
        and not figures["answers_without_a_row"]
        and not figures["rows_without_an_answer"]
        and not duplicates
        and cost == budget.spent_usd
        and budget.reserved_usd == 0
    )
    if not exact:
        raise SystemExit(f"the ledger does not match the requests: {figures}")
    return figures


def _breakdown(route, client_ttfts: list[float], warmup: int) -> dict:
    """Medians of where the paired gateway requests' TTFT went, from each answer's record."""
    from search.models import Answer

    answers = list(Answer.objects.filter(route=route).order_by("created_at"))[warmup:]
    names = (
        "request_to_answer_ms",
        "answer_to_submit_ms",
        "submit_to_worker_ms",
        "worker_ttft_ms",
        "http_and_relay_ms",
    )
    parts = {name: [] for name in names}
    for answer, client_ttft in zip(answers, client_ttfts, strict=True):
        timings = answer.timings
        parts["request_to_answer_ms"].append(timings["request_ms"])
        parts["answer_to_submit_ms"].append(timings["submit_ms"])
        parts["submit_to_worker_ms"].append(timings["queue_ms"])
        parts["worker_ttft_ms"].append(answer.stats["time_to_first_token_ms"])
        parts["http_and_relay_ms"].append(client_ttft - timings["request_ms"] - timings["ttft_ms"])
    return {name: round(statistics.median(values), 2) for name, values in parts.items()}


if __name__ == "__main__":
    main()
