"""The worker's routing cost: the same streamed requests to the same local server, directly with
the ``openai`` client and through the routed path a worker runs, in one run.

    python -m benchmarks.worker_routing_cost [--requests 300] [--warmup 30] [--keep]

What it times is the worker's side only: the plan, the key, the attempt through
``inference.remote``, the stream into Redis and the queued ledger row. Not the broker hop, queue
admission, client limits or the web tier's relay to the client: ``benchmarks.gateway_overhead``
times the whole path through ``/v1``. The headline, ``routing_cost_p50_ms``, is against the fair
baseline: a direct client that keeps its connection, as the routed side does.

Method
------
Server. The OpenAI-protocol stand-in of the tests (``tests/upstream_server.py``) runs as a
separate process on a free loopback port; every request asks for the same short reply
(``--tokens`` words, one chunk each, with the usage chunk), so both sides stream the very
same bytes.

Direct. One ``openai.OpenAI`` client created once, as a direct user would, with its
retries off; one request = ``chat.completions.create(stream=True)`` and reading the stream
to its end. The SDK stops reading at ``data: [DONE]`` and closes the response before the
end of the chunked body, so httpx closes the connection: each of these requests opens a
new one. Our remote backend reads those last bytes and keeps its connections
(``inference.remote.transport._WatchedStream``), so the comparison above gives the router that
advantage. Hence a second direct client that keeps its connection too ("direct kept": the
SDK's ``with_streaming_response``, reading the body's lines to the end, each chunk built
into the SDK's ``ChatCompletionChunk`` by the function its stream uses): the same HTTP and
parsing work as the routed side, so ``routing_cost_p50_ms`` is the routing's own cost.
``connections`` counts the connections each side opened (the stand-in's log).

Routed. What a worker does for a request, in this process, minus the broker hop (the same
for any task, and not the router's): ``router.plan`` (the default route, and the arm of a
live canary release on it: 10 % of 10,000-bucket HMAC arms, the canary route on its own
provider and keys at the same server; the process's resolved route, checked against the
routing version), ``router.check_available`` (answered by the plan), ``router.payload_for``,
then ``inference.execution.run_routed``: the route, the least recently used of 3 keys (one
``UPDATE ... RETURNING``), the cached decrypted secret, the attempt through
``inference.remote`` (the shared SDK client for that key, the deadline thread), each delta
written to the request's Redis stream, then the ``stats`` event with the ledger row queued
in the same ``MULTI``/``EXEC`` (``billing.ledger``). Every routed request is checked to
have streamed the same text.

Ledger. After each routed request, outside its timing, ``billing.ledger.usage_records_store`` stores the
queued row (and the key's success) in PostgreSQL, as ``generate_routed`` does once its
request has ended: ``ledger_store_p50_ms`` is that work, off the request's path. At the
end, every request must have exactly one stored row.

Breakdown. A separate pass of ``--breakdown`` routed requests, after the measured ones,
times each part of the routed path (the plan; the route with its first key; the attempt,
with the stream's events; the events alone, the terminal one with the queued ledger row) by
wrapping the functions that do them: ``breakdown_p50_ms``, medians per part.

Interleaving. After an untimed warm-up of each, the requests run in triples (direct,
direct kept, routed), the order rotating from one triple to the next, so that the machine's
drift falls on all alike. ``routing_cost_p50_ms`` and ``routing_cost_p99_ms`` are percentiles
of the per-triple differences (routed minus direct kept of the same triple);
``routing_cost_vs_new_connection_*`` the same against the direct client that opens a connection
per request (the SDK's default use).

Database. A database of its own, ``ragsite_bench_router``, on the project's PostgreSQL
(``DATABASE_URL``, else the embedded server under ``var/``), created and migrated here and
dropped at the end unless ``--keep``. Redis is the project's server, database number
``REDIS_DB`` (emptied first): the ledger's outbox and the streams here never meet a
running system's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import uuid

from benchmarks.common import own_databases, percentile, report

DATABASE = "ragsite_bench_routing"
REDIS_DB = 15
WORDS = "Lift rises with the angle of attack until the wing stalls near fifteen degrees".split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="Timed requests on each side.")
    parser.add_argument("--warmup", type=int, default=30, help="Untimed requests on each side first.")
    parser.add_argument("--tokens", type=int, default=8, help="Words in the reply (one chunk each).")
    parser.add_argument("--breakdown", type=int, default=100, help="Routed requests of the timed-parts pass.")
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database afterwards.")
    args = parser.parse_args()

    from tests.upstream_server import serving

    with own_databases(DATABASE, REDIS_DB, keep=args.keep), serving() as base_url:
        result = run(args, base_url)
    report("worker_routing_cost", result)


def run(args, base_url: str) -> dict:
    import openai
    from openai._models import construct_type  # what openai.Stream builds each chunk with
    from openai.types.chat import ChatCompletionChunk

    from billing import ledger
    from billing.models import UsageRecord
    from inference import router
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

    kept_key = f"sk-bench-kept-{uuid.uuid4().hex}"
    kept_client = openai.OpenAI(base_url=base_url, api_key=kept_key, max_retries=0)

    def direct_kept() -> tuple[float, str]:
        started = time.perf_counter()
        text = []
        with kept_client.chat.completions.with_streaming_response.create(
            model="m",
            messages=messages,
            max_tokens=stable.max_tokens,
            temperature=stable.temperature,
            top_p=stable.top_p,
            stream=True,
            stream_options={"include_usage": True},
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    # Each chunk built as the SDK's stream builds it (its typed model).
                    chunk = construct_type(type_=ChatCompletionChunk, value=json.loads(line[6:]))
                    text.extend(choice.delta.content or "" for choice in chunk.choices)
        return (time.perf_counter() - started) * 1000, "".join(text)

    arms = {"stable": 0, "canary": 0}
    stored_ms: list[float] = []

    def routed(number: int) -> tuple[float, str]:
        started = time.perf_counter()
        plan = router.plan(client_id=f"client-{number}")
        router.check_available(plan.route, key_usable=plan.key_usable)
        outcome = run_routed(plan.request_id, router.payload_for(plan, messages=messages))
        elapsed = (time.perf_counter() - started) * 1000
        if outcome["status"] != "ok":
            raise SystemExit(f"a routed request failed: {outcome['error']}")
        arms[plan.arm] += 1
        drain_started = time.perf_counter()
        if ledger.usage_records_store() != 1:
            raise SystemExit(f"the ledger row of {plan.request_id} was not stored by the drain after it")
        stored_ms.append((time.perf_counter() - drain_started) * 1000)
        return elapsed, outcome["text"]

    for number in range(args.warmup):
        direct()
        direct_kept()
        routed(-1 - number)

    arms = {"stable": 0, "canary": 0}
    stored_ms.clear()
    direct_ms, routed_ms = [], []
    kept_ms = []
    for number in range(args.requests):
        sides = [("direct", direct), ("kept", direct_kept), ("routed", functools.partial(routed, number))]
        timed = {}
        for name, side in sides[number % 3 :] + sides[: number % 3]:
            timed[name] = side()
        texts = {name: text for name, (_, text) in timed.items()}
        if set(texts.values()) != {reply}:
            raise SystemExit(f"the replies differ: {texts}, expected {reply!r}")
        direct_ms.append(timed["direct"][0])
        kept_ms.append(timed["kept"][0])
        routed_ms.append(timed["routed"][0])

    store = list(stored_ms)
    breakdown = breakdown_pass(routed, args.breakdown)

    differences = [r - d for r, d in zip(routed_ms, direct_ms, strict=True)]
    kept_differences = [r - d for r, d in zip(routed_ms, kept_ms, strict=True)]
    rows = UsageRecord.objects.filter(status="ok").count()
    expected_rows = args.requests + args.warmup + args.breakdown
    if rows != expected_rows:
        raise SystemExit(f"expected {expected_rows} ledger rows, found {rows}")
    uses = sorted(UpstreamKey.objects.values_list("success_count", flat=True))
    from tests.upstream_server import upstream_log

    def opened(*secrets: str) -> int:
        return len({(secret, entry["client_port"]) for secret in secrets for entry in upstream_log(base_url, secret)})

    routed_secrets = [key.secret() for key in UpstreamKey.objects.all()]
    connections = {
        "direct": opened(client.api_key),
        "direct_kept": opened(kept_key),
        "routed": opened(*routed_secrets),
    }
    return {
        "requests": args.requests,
        "reply_tokens": args.tokens,
        "direct_kept_p50_ms": round(statistics.median(kept_ms), 3),
        "routed_p50_ms": round(statistics.median(routed_ms), 3),
        "routing_cost_p50_ms": round(statistics.median(kept_differences), 3),
        "routing_cost_p99_ms": round(percentile(kept_differences, 99), 3),
        "routing_cost_method": "percentiles of per-triple differences (routed minus direct kept, same triple)",
        "direct_new_connection_p50_ms": round(statistics.median(direct_ms), 3),
        "routing_cost_vs_new_connection_p50_ms": round(statistics.median(differences), 3),
        "routing_cost_vs_new_connection_p99_ms": round(percentile(differences, 99), 3),
        "connections": connections,
        # Storing the queued ledger row, after the request (billing.ledger.usage_records_store).
        "ledger_store_p50_ms": round(statistics.median(store), 3),
        "ledger_store_p99_ms": round(percentile(store, 99), 3),
        "direct_kept_p99_ms": round(percentile(kept_ms, 99), 3),
        "direct_new_connection_p99_ms": round(percentile(direct_ms, 99), 3),
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
        (execution.Routing, "attempt", "attempt_with_events"),
        (streams.PipelinedStreamWriter, "write", "stream_events"),
        (streams.PipelinedStreamWriter, "flush", "stream_events"),
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
