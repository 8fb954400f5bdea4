"""What showing only verified text costs a streaming client: the first chunk of a streamed chat
completion through our OpenAI-compatible ``/v1`` as it streams now (each sentence once it is
complete and checked, docs/answers.md "Verified while streaming") against the same completion
with ``unverified_tokens`` (the model's own tokens as it writes them: what every stream showed
before), in one run, paired.

    python -m benchmarks.verified_stream [--requests 40] [--warmup 4] [--token-delay-ms 50] [--keep]

What runs. The system as ``manage.py up`` runs it (``benchmarks.common.system_start``): the web
process, a ``remote`` worker (threads pool) and the ``ingest,default`` worker. The upstream is the
OpenAI-protocol stand-in of the tests, pacing its stream (``--token-delay-ms`` before each word,
as a model decodes). The workspace holds the tests' three small documents, embedded by
all-MiniLM-L6-v2; the route abstains, so each answer is retrieved, judged relevant, generated,
and its sentences checked against its passages by the worker while it streams. Every reply is the
same two supported sentences (``REPLY``), so both sides stream the same text.

Measured, one request at a time, the order alternating from pair to pair after an untimed warm-up:
``first_token``: from the call to the first chunk with content of the unverified stream;
``first_verified``: the same for the verified stream (its first chunk is the first sentence,
checked); ``total`` of each, to the stream's end. ``verified_over_token_p50``: the ratio of the
two medians; ``first_sentence_tokens``: how many words the model wrote before the first verified
chunk could go. The verified text must equal the unverified one (both supported in full) and the
stored answer, for every pair; the run fails otherwise.

A database of its own (``ragsite_bench_verified``, dropped after unless ``--keep``) and Redis
database 11, emptied first.
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

from benchmarks.common import logs_folder, own_databases, percentile, report, system_start

DATABASE = "ragsite_bench_verified"
REDIS_DB = 11
DOCUMENTS = {
    "robot.md": "# Atlas-7 robot\n\nThe Atlas-7 warehouse robot runs for 10 hours on one battery charge. "
    "Charging takes 90 minutes.",
    "wing.md": "# Wing aerodynamics\n\nLift rises with the angle of attack until the wing stalls.",
}
REPLY = "The Atlas-7 warehouse robot runs for 10 hours on one battery charge [1]. Charging takes 90 minutes [1]."
QUESTION = "How long does the Atlas-7 robot run on one charge, and how long does charging take?"
REQUEST_TIMEOUT_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40, help="Measured pairs (unverified, verified).")
    parser.add_argument("--warmup", type=int, default=4, help="Untimed pairs first.")
    parser.add_argument("--token-delay-ms", type=int, default=50, help="The stand-in's wait before each word.")
    parser.add_argument("--keep", action="store_true", help=f"Keep the {DATABASE} database and the logs afterwards.")
    args = parser.parse_args()
    if args.requests < 1 or args.warmup < 0 or args.token_delay_ms < 0:
        parser.error("--requests is at least 1, --warmup and --token-delay-ms at least 0")

    from tests.upstream_server import serving

    with (
        own_databases(DATABASE, REDIS_DB, keep=args.keep),
        serving() as upstream,
        logs_folder("bench-verified-", keep=args.keep) as folder,
    ):
        result = run(args, upstream, Path(folder))
    report("verified_stream", result)


def run(args, upstream: str, folder: Path) -> dict:
    import openai

    from billing import client_keys
    from inference.models import Provider, Route, UpstreamKey
    from search.ingest import pipeline
    from search.models import Answer
    from search.services import collection_create, document_create, workspace_create
    from tests.upstream_server import upstream_script

    workspace = workspace_create(name="Verified", slug="verified")
    collection = collection_create(workspace=workspace, name="Handbook")
    ids = [
        document_create(collection=collection, source_name=name, content=text.encode(), enqueue=False)[0].pk
        for name, text in DOCUMENTS.items()
    ]
    pipeline.documents_ingest(document_ids=ids)
    provider = Provider.objects.create(
        name="bench", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url=upstream, model="stand-in-7b"
    )
    secret = f"sk-verified-{uuid.uuid4().hex}"
    key = UpstreamKey(provider=provider, label="bench")
    key.set_secret(secret)
    key.save()
    Route.objects.create(name="bench", provider=provider, is_default=True, max_tokens=64, temperature=0.0)
    upstream_script(upstream, secret, [{"token_delay_ms": args.token_delay_ms, "repeat": True}])
    _, token = client_keys.client_key_create(workspace, "verified", scopes=["generate"])

    base_url, processes = system_start(
        folder,
        workers={
            "remote": ["-Q", "remote", "--pool", "threads", "-c", "4"],
            "ingest": ["-Q", "ingest,default", "-c", "2"],
        },
    )
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0, timeout=REQUEST_TIMEOUT_S)

        def call(number: int, unverified: bool) -> tuple[float, float, str, str]:
            messages = [{"role": "user", "content": f"{QUESTION} ({number})\nREPLY: {REPLY}"}]
            started = time.perf_counter()
            first, parts, completion_id = None, [], ""
            extra = {"unverified_tokens": True} if unverified else {}
            for chunk in client.chat.completions.create(
                model="bench", messages=messages, stream=True, extra_body=extra
            ):
                completion_id = chunk.id
                content = chunk.choices[0].delta.content if chunk.choices else None
                if content:
                    first = first if first is not None else time.perf_counter()
                    parts.append(content)
            ended = time.perf_counter()
            if first is None:
                raise SystemExit(f"request {number} streamed no content")
            return (first - started) * 1000, (ended - started) * 1000, "".join(parts), completion_id

        for number in range(args.warmup):
            call(number, True)
            call(number, False)
        measured = {True: {"first": [], "total": []}, False: {"first": [], "total": []}}
        for number in range(args.requests):
            texts = {}
            for unverified in (True, False) if number % 2 == 0 else (False, True):
                first, total, texts[unverified], completion_id = call(args.warmup + number, unverified)
                measured[unverified]["first"].append(first)
                measured[unverified]["total"].append(total)
            stored = _stored_text(Answer, completion_id.removeprefix("chatcmpl-"))
            if not texts[True] == texts[False] == REPLY == stored:
                raise SystemExit(f"pair {number}: the streams or the stored answer differ: {texts!r}, {stored!r}")
    finally:
        for process in processes:
            process.stop()

    token_first, verified_first = measured[True]["first"], measured[False]["first"]
    token_p50, verified_p50 = percentile(token_first, 50, 1), percentile(verified_first, 50, 1)
    return {
        "requests": args.requests,
        "token_delay_ms": args.token_delay_ms,
        "first_token_p50_ms": token_p50,
        "first_token_p99_ms": percentile(token_first, 99, 1),
        "first_verified_p50_ms": verified_p50,
        "first_verified_p99_ms": percentile(verified_first, 99, 1),
        "verified_over_token_p50": round(verified_p50 / token_p50, 2) if token_p50 else None,
        "unverified_total_p50_ms": percentile(measured[True]["total"], 50, 1),
        "verified_total_p50_ms": percentile(measured[False]["total"], 50, 1),
        "first_sentence_tokens": len(REPLY.split(". ")[0].split()),
    }


def _stored_text(answer_model, answer_id: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while (answer := answer_model.objects.get(pk=answer_id)).status not in ("done", "failed"):
        if time.monotonic() > deadline:
            raise SystemExit(f"answer {answer_id} not stored after {timeout} s")
        time.sleep(0.05)
    return answer.text


if __name__ == "__main__":
    main()
