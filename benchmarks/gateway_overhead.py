"""The gateway's price: one streamed chat completion through our OpenAI-compatible ``/v1`` and
the same completion from the same upstream called directly, in one run.

    python -m benchmarks.gateway_overhead [--requests 200] [--warmup 20] [--tokens 16] [--keep]

What runs. The system as ``manage.py up`` runs it, each part its own process on 127.0.0.1:
the web process (uvicorn, ASGI), a ``remote`` worker (threads pool) and a ``default`` worker
(it stores each answer once its stream has ended, off the client's path). The upstream is the
OpenAI-protocol stand-in of the tests (``tests/upstream_server.py``), which answers at once:
every request's last user message ends with ``REPLY: <--tokens words>`` and the stand-in
streams exactly those words, one chunk each, so the two sides stream the same text (checked
for every pair).

Direct. The official ``openai`` client (retries off), created once, calling the stand-in:
``chat.completions.create(stream=True, stream_options={"include_usage": True})``, read to its
end. Gateway. The same call with the same client library, ``base_url`` our ``/v1`` and a
client key (no limits set): authentication, admission against the key's limits, the answer's
row, the route's plan, the prompt, the message on queue ``remote``, the worker's routed call
to the stand-in streamed into Redis, the web process relaying the stream as Server-Sent
Events, the ledger row. The key's workspace has no collection, so retrieval finds nothing at
once: retrieval's own cost is ``benchmarks.search_scale``'s and the load benchmark's, not the
gateway's.

Timing. ``ttft``: from the call until the first chunk with content; ``total``: until the
stream's end. Requests run in pairs (direct, gateway), the order alternating from one pair to
the next, after an untimed warm-up of each: the machine's drift falls on both alike.
``overhead_ttft_p50_ms``/``p99``: percentiles of the per-pair differences (gateway minus
direct); ``overhead_total_p50_ms`` likewise.

Where the time goes (medians over the gateway's requests, from each answer's own record):
``request_to_row_ms`` (the answer's ``request_ms``), from the request reaching the middleware
to the answer's row: authentication, the body, the route; ``row_to_prompt_ms``
(``submit_ms``): the plan, retrieval, the prompt; ``prompt_to_worker_ms`` (``queue_ms``): the
row's update, admission, the message on the queue, the broker hop, the worker's pickup;
``worker_ttft_ms``: the attempt's own time to its first token from the stand-in (the worker's
HTTP call); ``http_and_relay_ms``, the client's TTFT minus ``request_ms`` minus the answer's
``ttft_ms`` (row to first token in Redis): the HTTP request up to the middleware (uvicorn,
Django's handler) and the relay from Redis to the client (the stream's read, the response's
start, the first chunks). A database of its own (``ragsite_bench_gateway``, dropped after
unless ``--keep``) and Redis database 10, emptied first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import own_databases, percentile, report, system_start

DATABASE = "ragsite_bench_gateway"
REDIS_DB = 10
WORDS = "Lift rises with the angle of attack until the wing stalls near fifteen degrees and then falls".split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="Measured pairs (direct, gateway).")
    parser.add_argument("--warmup", type=int, default=20, help="Untimed requests of each side first.")
    parser.add_argument("--tokens", type=int, default=16, help="Words of every reply (one chunk each).")
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database afterwards.")
    args = parser.parse_args()
    if args.requests < 1 or not 1 <= args.tokens <= len(WORDS):
        parser.error(f"--requests is at least 1; --tokens is from 1 to {len(WORDS)}")

    from tests.upstream_server import serving

    with (
        own_databases(DATABASE, REDIS_DB, keep=args.keep),
        serving() as upstream,
        tempfile.TemporaryDirectory(prefix="bench-gateway-") as folder,
    ):
        result = run(args, upstream, Path(folder))
    report("gateway_overhead", result)


def run(args, upstream: str, folder: Path) -> dict:
    import openai

    from billing import client_keys
    from billing.models import UsageRecord
    from inference.models import Provider, Route, UpstreamKey
    from search.models import Answer
    from search.services import workspace_create

    workspace = workspace_create(name="Gateway", slug="gateway")
    provider = Provider.objects.create(
        name="stand-in", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=upstream, model="stand-in-7b"
    )
    secret = f"sk-gateway-{uuid.uuid4().hex}"
    key = UpstreamKey(provider=provider, label="bench")
    key.set_secret(secret)
    key.save()
    # What is timed is the path to the upstream and back: every request generates (a workspace
    # without documents would otherwise decline at once, search.abstention).
    route = Route.objects.create(
        name="bench", provider=provider, is_default=True, max_tokens=64, temperature=0.0, abstains=False
    )
    token = client_keys.client_key_create(workspace, "gateway", scopes=["generate"])[1]
    reply = " ".join(WORDS[: args.tokens])

    direct_client = openai.OpenAI(base_url=upstream, api_key=secret, max_retries=0)
    base_url, processes = system_start(
        folder,
        workers={"remote": ["-Q", "remote", "--pool", "threads", "-c", "8"], "default": ["-Q", "default", "-c", "1"]},
    )
    try:
        gateway_client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0)

        def call(client, model: str, number: int) -> tuple[float, float, str]:
            messages = [{"role": "user", "content": f"Request {number}.\nREPLY: {reply}"}]
            started = time.perf_counter()
            first, parts = None, []
            stream = client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=route.max_tokens,
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

        sides = {"direct": (direct_client, provider.model), "gateway": (gateway_client, route.name)}
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
        breakdown = _breakdown(Answer, UsageRecord, measured["gateway"]["ttft"], args)
    finally:
        for process in processes:
            process.stop()

    def p(values, q):
        return round(percentile(values, q), 2)

    ttft_overhead = [g - d for g, d in zip(measured["gateway"]["ttft"], measured["direct"]["ttft"], strict=True)]
    total_overhead = [g - d for g, d in zip(measured["gateway"]["total"], measured["direct"]["total"], strict=True)]
    return {
        "requests": args.requests,
        "reply_tokens": args.tokens,
        "direct_ttft_p50_ms": p(measured["direct"]["ttft"], 50),
        "direct_ttft_p99_ms": p(measured["direct"]["ttft"], 99),
        "gateway_ttft_p50_ms": p(measured["gateway"]["ttft"], 50),
        "gateway_ttft_p99_ms": p(measured["gateway"]["ttft"], 99),
        "overhead_ttft_p50_ms": p(ttft_overhead, 50),
        "overhead_ttft_p99_ms": p(ttft_overhead, 99),
        "direct_total_p50_ms": p(measured["direct"]["total"], 50),
        "direct_total_p99_ms": p(measured["direct"]["total"], 99),
        "gateway_total_p50_ms": p(measured["gateway"]["total"], 50),
        "gateway_total_p99_ms": p(measured["gateway"]["total"], 99),
        "overhead_total_p50_ms": p(total_overhead, 50),
        "overhead_total_p99_ms": p(total_overhead, 99),
        "breakdown_p50_ms": breakdown,
    }


def _breakdown(Answer, UsageRecord, client_ttfts: list[float], args) -> dict:
    """Medians of where the gateway's TTFT went, from each answer's record (see the module docstring)."""
    deadline = time.monotonic() + 60  # the default worker stores the last answers after their streams ended
    expected = args.warmup + args.requests
    while Answer.objects.filter(status=Answer.Status.DONE).count() < expected:
        if time.monotonic() > deadline:
            statuses = list(Answer.objects.values_list("status", flat=True))
            raise SystemExit(f"answers not all completed: {statuses.count('done')} of {expected}")
        time.sleep(0.2)
    rows = UsageRecord.objects.filter(kind=UsageRecord.Kind.GENERATION).count()
    if rows != expected:
        raise SystemExit(f"{rows} ledger rows for {expected} answers")
    answers = list(Answer.objects.order_by("created_at"))[args.warmup :]
    names = ("request_to_row_ms", "row_to_prompt_ms", "prompt_to_worker_ms", "worker_ttft_ms", "http_and_relay_ms")
    parts = {name: [] for name in names}
    for answer, client_ttft in zip(answers, client_ttfts, strict=True):
        timings = answer.timings
        parts["request_to_row_ms"].append(timings["request_ms"])
        parts["row_to_prompt_ms"].append(timings["submit_ms"])
        parts["prompt_to_worker_ms"].append(timings["queue_ms"])
        parts["worker_ttft_ms"].append(answer.stats["time_to_first_token_ms"])
        parts["http_and_relay_ms"].append(client_ttft - timings["request_ms"] - timings["ttft_ms"])
    return {name: round(statistics.median(values), 2) for name, values in parts.items()}


if __name__ == "__main__":
    main()
