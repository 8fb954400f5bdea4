"""Router overhead: the same streamed requests to the same local server, directly with the
``openai`` client and through our router, in one run.

    python -m benchmarks.router_overhead [--requests 300] [--warmup 30] [--keep]

Method
------
Server. The OpenAI-protocol stand-in of the tests (``tests/upstream_server.py``) runs as a
separate process on a free loopback port; every request asks for the same short reply
(``--tokens`` words, one chunk each, with the usage chunk), so both sides stream the very
same bytes.

Direct. One ``openai.OpenAI`` client created once, as a direct user would, with its
retries off; one request = ``chat.completions.create(stream=True)`` and reading the stream
to its end.

Routed. What a worker does for a request, in this process, minus the broker hop (the same
for any task, and not the router's): ``router.plan`` (the default route, and the arm of a
live canary release on it: 10 % of 10,000-bucket HMAC arms, the canary route on its own
provider and keys at the same server), ``router.check_available`` (the one-query key
availability check that ``submit`` makes before enqueueing), ``router.payload_for``, then
``inference.execution.run_routed``: the route, the least recently used of 3 keys (one
``UPDATE ... RETURNING``), the cached decrypted secret, the attempt through
``inference.remote`` (the shared SDK client for that key, the deadline thread), each delta
written to the request's Redis stream, the key's success, the ``stats`` event and the ledger
row (``UsageRecord``). Every routed request is checked to have streamed the same text.

Breakdown. A separate pass of ``--breakdown`` routed requests, after the measured ones,
times each part of the routed path (the plan; the route with its first key; the attempt,
with the stream's events; the events alone; the ledger row with the key's success) by
wrapping the functions that do them: ``breakdown_p50_ms``, medians per part.

Interleaving. After an untimed warm-up of both, the requests run in pairs, direct then
routed or routed then direct, alternating, so that the machine's drift falls on both alike.
``overhead_p50_ms`` and ``overhead_p99_ms`` are percentiles of the per-pair differences
(routed minus direct of the same pair); ``p50_difference_ms`` is routed p50 minus direct
p50, for comparison.

Database. A database of its own, ``ragsite_bench_router``, on the project's PostgreSQL
(``DATABASE_URL``, else the embedded server under ``var/``), created and migrated here and
dropped at the end unless ``--keep``. Redis is the project's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

from benchmarks.common import django_setup, report

DATABASE = "ragsite_bench_router"
WORDS = "Lift rises with the angle of attack until the wing stalls near fifteen degrees".split()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return statistics.quantiles(ordered, n=100, method="inclusive")[q - 1] if len(ordered) > 1 else ordered[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="Timed requests on each side.")
    parser.add_argument("--warmup", type=int, default=30, help="Untimed requests on each side first.")
    parser.add_argument("--tokens", type=int, default=8, help="Words in the reply (one chunk each).")
    parser.add_argument("--breakdown", type=int, default=100, help="Routed requests of the timed-parts pass.")
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database afterwards.")
    args = parser.parse_args()

    # A database of our own on the project's server, chosen before Django reads its settings.
    import psycopg
    from psycopg import sql

    from benchmarks.search_scale import server_url, with_database

    server = server_url()
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DATABASE)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
    os.environ["DATABASE_URL"] = with_database(server, DATABASE)
    django_setup()

    from django.core.management import call_command
    from django.db import connections

    from tests.upstream_server import serving

    try:
        with serving() as base_url:
            call_command("migrate", verbosity=0)
            result = run(args, base_url)
    finally:
        connections.close_all()
        if not args.keep:
            with psycopg.connect(server, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DATABASE)))
    report("router_overhead", result)


def run(args, base_url: str) -> dict:
    import openai

    from billing.models import UsageRecord
    from inference import execution, router
    from inference.execution import run_routed
    from inference.models import CanaryRelease, Provider, Route, UpstreamKey

    def provider_with_keys(name: str) -> Provider:
        kind = Provider.Kind.OPENAI_COMPATIBLE
        provider = Provider.objects.create(name=name, kind=kind, base_url=base_url, model="m")
        for label in ("a", "b", "c"):
            key = UpstreamKey(provider=provider, label=f"{name} {label}")
            key.set_secret(f"sk-bench-{name}-{label}-{uuid.uuid4().hex}")
            key.save()
        return provider

    reply = "".join(f" {word}" if i else word for i, word in enumerate(WORDS[: args.tokens]))
    messages = [{"role": "user", "content": f"Answer from the passages.\nREPLY: {reply}"}]
    stable = Route.objects.create(name="bench", provider=provider_with_keys("bench-stable"), is_default=True)
    canary = Route.objects.create(name="bench-canary", provider=provider_with_keys("bench-canary"))
    CanaryRelease.objects.create(name="bench", stable_route=stable, canary_route=canary, percent=10)

    client = openai.OpenAI(base_url=base_url, api_key=f"sk-bench-direct-{uuid.uuid4().hex}", max_retries=0)

    def direct() -> tuple[float, str]:
        started = time.perf_counter()
        stream = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=stable.max_tokens,
            temperature=stable.temperature,
            top_p=stable.top_p,
            stream=True,
            stream_options={"include_usage": True},
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        return (time.perf_counter() - started) * 1000, text

    arms = {"stable": 0, "canary": 0}
    # The worker writes the ledger row after the stream's terminal event is in Redis: the
    # moment ledger_write starts is when a reader has the whole answer.
    answered = {}
    ledger_write = execution.ledger_write

    def ledger_write_timed(*args, **kwargs):
        answered["at"] = time.perf_counter()
        return ledger_write(*args, **kwargs)

    execution.ledger_write = ledger_write_timed

    def routed(number: int) -> tuple[float, str]:
        started = time.perf_counter()
        plan = router.plan(client_id=f"client-{number}")
        router.check_available(plan.route, key_usable=plan.key_usable)
        outcome = run_routed(plan.request_id, router.payload_for(plan, messages=messages))
        elapsed = (time.perf_counter() - started) * 1000
        if outcome["status"] != "ok":
            raise SystemExit(f"a routed request failed: {outcome['error']}")
        arms[plan.arm] += 1
        routed_answered_ms.append((answered["at"] - started) * 1000)
        return elapsed, outcome["text"]

    routed_answered_ms: list[float] = []

    for number in range(args.warmup):
        direct()
        routed(-1 - number)

    arms = {"stable": 0, "canary": 0}
    routed_answered_ms.clear()
    direct_ms, routed_ms = [], []
    for number in range(args.requests):
        if number % 2:
            d, d_text = direct()
            r, r_text = routed(number)
        else:
            r, r_text = routed(number)
            d, d_text = direct()
        if d_text != reply or r_text != reply:
            raise SystemExit(f"the replies differ: direct {d_text!r}, routed {r_text!r}, expected {reply!r}")
        direct_ms.append(d)
        routed_ms.append(r)

    answered_ms = list(routed_answered_ms)
    breakdown = breakdown_pass(routed, args.breakdown)
    execution.ledger_write = ledger_write

    differences = [r - d for r, d in zip(routed_ms, direct_ms, strict=True)]
    to_answer = [r - d for r, d in zip(answered_ms, direct_ms, strict=True)]
    rows = UsageRecord.objects.filter(status="ok").count()
    expected_rows = args.requests + args.warmup + args.breakdown
    if rows != expected_rows:
        raise SystemExit(f"expected {expected_rows} ledger rows, found {rows}")
    uses = sorted(UpstreamKey.objects.values_list("success_count", flat=True))
    return {
        "requests": args.requests,
        "reply_tokens": args.tokens,
        "direct_p50_ms": round(statistics.median(direct_ms), 3),
        "routed_p50_ms": round(statistics.median(routed_ms), 3),
        "overhead_p50_ms": round(statistics.median(differences), 3),
        "overhead_p99_ms": round(percentile(differences, 99), 3),
        "overhead_method": "percentiles of per-pair differences (routed minus direct, same pair)",
        # The same, up to the terminal event (what a reader waits for); the ledger row
        # and the key's success count are written after it.
        "answer_overhead_p50_ms": round(statistics.median(to_answer), 3),
        "answer_overhead_p99_ms": round(percentile(to_answer, 99), 3),
        "p50_difference_ms": round(statistics.median(routed_ms) - statistics.median(direct_ms), 3),
        "direct_p99_ms": round(percentile(direct_ms, 99), 3),
        "routed_p99_ms": round(percentile(routed_ms, 99), 3),
        "canary_share": round(arms["canary"] / args.requests, 3),
        "key_uses": uses,
        "ledger_rows": rows,
        "breakdown_p50_ms": breakdown,
        "breakdown_method": f"a separate pass of {args.breakdown} routed requests with timers around each part",
    }


def breakdown_pass(routed, requests: int) -> dict:
    """Where a routed request's time goes: p50 per part over ``requests`` requests, each
    part timed by wrapping the function that does it (for this pass only)."""
    from inference import execution, keypool, router, streams

    spent: dict[str, float] = {}
    wrapped = [
        (router, "plan", "plan"),
        (keypool, "route_with_key", "route_and_key"),
        (execution.Routing, "attempt_remote", "attempt_with_events"),
        (streams.PipelinedStreamWriter, "write", "stream_events"),
        (streams.PipelinedStreamWriter, "flush", "stream_events"),
        (execution, "ledger_write", "ledger_and_key_success"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]

    def timer(function, part):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[part] = spent.get(part, 0.0) + (time.perf_counter() - started) * 1000

        return timed

    for owner, name, part in wrapped:
        setattr(owner, name, timer(getattr(owner, name), part))
    per_request: dict[str, list[float]] = {}
    try:
        for number in range(requests):
            spent.clear()
            spent["total"] = routed(10**6 + number)[0]
            for part, value in spent.items():
                per_request.setdefault(part, []).append(value)
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
    return {part: round(statistics.median(values), 3) for part, values in per_request.items()}


if __name__ == "__main__":
    main()
