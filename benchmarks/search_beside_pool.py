"""Search latency on a running system, to compare it with the GPU pool idle and with no pool.

    python -m benchmarks.search_beside_pool --base-url http://127.0.0.1:8000 --key KEY --label pool-idle
    python -m benchmarks.search_beside_pool --base-url http://127.0.0.1:8000 --key KEY --label no-pool

Against ``manage.py up`` on its defaults (the demo corpus and the demo model's pool), then
against ``GPU_POOL_MODEL=off manage.py up``: the pool's vLLM server, idle, keeps its threads
bound to its cores and its KV cache reserved, and this says what that costs a search. ``KEY``:
a client key of the demo workspace with the ``search`` scope (``billing.client_keys``).

Each question of ``--questions`` (default ``demo/qa.jsonl``) is searched ``--rounds`` times
(hybrid, top 8, one request at a time, after ``--warmup`` untimed searches) through REST API
v1 (``POST /api/v1/search``); ``search_p50_ms``/``p99``: from sending the request to reading the
whole response, on this client. One run per label writes ``benchmarks/results/
search_beside_pool_<label>.json``; docs/benchmarks.md puts the two side by side.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx2

from benchmarks.common import ROOT, percentile, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", required=True, help="A client key with the search scope.")
    parser.add_argument("--label", required=True, help="What runs beside the searches (pool-idle, no-pool).")
    parser.add_argument("--questions", type=Path, default=ROOT / "demo" / "qa.jsonl")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    questions = [json.loads(line)["question"] for line in args.questions.read_text().splitlines() if line.strip()]
    headers = {"Authorization": f"Bearer {args.key}"}
    timings: list[float] = []
    with httpx2.Client(base_url=args.base_url, headers=headers, timeout=60) as client:

        def search(question: str) -> float:
            started = time.perf_counter()
            response = client.post("/api/v1/search", json={"query": question, "mode": "hybrid", "top_k": 8})
            response.raise_for_status()
            return (time.perf_counter() - started) * 1000

        for question in questions[: args.warmup]:
            search(question)
        for _ in range(args.rounds):
            timings.extend(search(question) for question in questions)
    report(
        f"search_beside_pool_{args.label}",
        {
            "corpus": "the running system's (demo by default)",
            "label": args.label,
            "searches": len(timings),
            "search_p50_ms": percentile(timings, 50, 1),
            "search_p99_ms": percentile(timings, 99, 1),
        },
    )


if __name__ == "__main__":
    main()
