"""``/metrics``: Prometheus text from every process (multiprocess mode), and its protection.

One end-to-end test: real traffic through a uvicorn process and a Celery worker (every
queue; its tasks run in a pool process), both writing to a multiprocess folder of their own
so that counts are exact, then a scrape of the web process, parsed with prometheus_client's
own parser, with every family of the catalogue (ragsite/metrics.py) checked. The protection
and a scrape with Redis unreachable run in this process.
"""

from __future__ import annotations

import time
import uuid
from decimal import Decimal

import pytest
import requests
from django.conf import settings
from django.test import Client, override_settings
from prometheus_client.parser import text_string_to_metric_families

from billing import client_keys
from billing.models import Price
from inference.models import CanaryRelease, Provider, Route
from search.models import Document
from search.services import collection_create, document_create, workspace_create
from tests.inference.routing_helpers import key_make, provider_make, route_make
from tests.upstream_server import upstream_script

pytestmark = pytest.mark.django_db(transaction=True)

DOCUMENTS = {
    "charging.txt": "The charger fills the battery in four hours. Fast charging takes one hour at a station.",
    "wings.txt": "Lift rises with the angle of attack until the wing stalls at the critical angle.",
}


def scrape(text: str) -> dict[str, dict[tuple, float]]:
    """Samples by name, each ``{sorted label items: value}``."""
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def label_values(samples: dict, name: str, label: str) -> set[str]:
    return {dict(key)[label] for key in samples.get(name, {})}


def test_metrics_of_every_process_after_real_traffic(start_web, start_worker, upstream_server, tmp_path, draft_pool):
    workspace = workspace_create(name="Metrics", slug=f"metrics-{uuid.uuid4().hex[:6]}")
    collection = collection_create(workspace=workspace, name="Handbook")
    # The seeded price of the local pool (billing 0003), gone if an earlier transactional test flushed the tables.
    if not Price.objects.filter(model="local").exists():
        Price.objects.create(
            model="local", input_usd_per_million=Decimal("0.02"), output_usd_per_million=Decimal("0.10")
        )

    # A GPU pool whose vLLM drafts with the target itself: greedy proposals are all accepted.
    target = draft_pool.model
    pool = Provider.objects.create(name="pool", **draft_pool.provider_fields())
    engine_before = draft_pool.counters()
    pool_route = Route.objects.create(name="pool", provider=pool, max_tokens=12)
    # A remote route whose only key gets one 500: the request fails over to a second upstream.
    failing = provider_make(upstream_server)
    _, failing_key = key_make(failing)
    upstream_script(upstream_server, failing_key, [{"status": 500}])
    backup = route_make(provider_make(upstream_server))
    key_make(backup.provider)
    remote = route_make(failing, fallbacks=(backup,))
    # A live release at 0 %: every client of "pool" is on its stable arm.
    CanaryRelease.objects.create(name="next", stable_route=pool_route, canary_route=backup, percent=Decimal("0"))
    budgeted, search_token = client_keys.client_key_create(
        workspace, "search", scopes=["search"], monthly_budget_usd=10
    )
    _, generate_token = client_keys.client_key_create(workspace, "generate", scopes=["generate"])

    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prometheus")}
    with (
        start_worker(["ingest", "gpu", "remote", "default"], env=env),
        start_web(env=env) as site,
        requests.Session() as http,
    ):
        for name, text in DOCUMENTS.items():  # ingested by the worker
            document_create(collection=collection, source_name=name, content=text.encode())
        deadline = time.monotonic() + 60
        while Document.objects.filter(status=Document.Status.INDEXED).count() < len(DOCUMENTS):
            assert time.monotonic() < deadline, list(Document.objects.values("status", "error"))
            time.sleep(0.2)
        searched = http.post(
            f"{site}/api/v1/search",
            json={"query": "charging hours"},
            headers={"Authorization": f"Bearer {search_token}"},
            timeout=120,
        )
        assert searched.status_code == 200, searched.text
        assert searched.json()["results"]
        for model in ("pool", remote.name):
            answered = http.post(
                f"{site}/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "How long does charging take?"}]},
                headers={"Authorization": f"Bearer {generate_token}"},
                timeout=120,
            )
            assert answered.status_code == 200, answered.text
        assert http.get(f"{site}/no/such/page", timeout=30).status_code == 404
        # The worker counts a generation after its last event, and stores its ledger row
        # (the cost rollups) after that: scrape until both are in.
        deadline = time.monotonic() + 30
        while True:
            response = http.get(f"{site}/metrics", timeout=30)
            assert response.status_code == 200
            samples = scrape(response.text)
            costs = {dict(key)["model"] for key in samples.get("ragsite_cost_usd", {})}
            done = len(samples.get("ragsite_generations_total", {})) == 2 and {target, "stand-in-7b"} <= costs
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    engine_moved = {key: count - engine_before.get(key, 0.0) for key, count in draft_pool.counters().items()}

    assert response.headers["content-type"].startswith("text/plain; version=")
    # HTTP: by URL pattern, never by raw path.
    http_routes = label_values(samples, "ragsite_http_requests_total", "route")
    assert {"api/v1/search", "v1/chat/completions", "unmatched"} <= http_routes
    assert not any("no/such" in route for route in http_routes)
    assert value(samples, "ragsite_http_requests_total", route="api/v1/search", method="POST", status="200") == 1
    assert value(samples, "ragsite_http_requests_total", route="v1/chat/completions", method="POST", status="200") == 2
    assert value(samples, "ragsite_http_requests_total", route="unmatched", method="GET", status="404") == 1
    assert value(samples, "ragsite_http_request_duration_seconds_count", route="api/v1/search", method="POST") == 1

    # Retrieval: the search, and the answers' own retrievals (hybrid), all in the web process.
    assert value(samples, "ragsite_search_duration_seconds_count", mode="hybrid") == 3
    # The cache is the session's Redis; the second answer's question is the first one's. Each
    # answer looks its question up once more, to judge whether its sources answer it
    # (search.answering.abstention): a hit, since its retrieval has just embedded it. The pool's answer
    # (an untrained model's text, which nothing supports) is quoted from its sources instead,
    # which looks the question up once more (search.answering.answers._quoted_instead).
    assert sum(samples["ragsite_query_embedding_cache_total"].values()) == 6
    assert value(samples, "ragsite_query_embedding_cache_total", result="hit") >= 3
    documents = {dict(key)["status"]: count for key, count in samples["ragsite_documents"].items()}
    assert documents["indexed"] == 2 and documents["failed"] == 0
    assert value(samples, "ragsite_ingest_documents_total", status="indexed") == 2
    assert value(samples, "ragsite_ingest_documents_total", status="failed") == 0
    assert samples["ragsite_ingest_chunks_total"][()] == sum(Document.objects.values_list("chunks_total", flat=True))

    # Generation, recorded by the worker's pool process.
    assert value(samples, "ragsite_generations_total", route="pool", arm="stable", status="ok") == 1
    assert value(samples, "ragsite_generations_total", route=backup.name, arm="none", status="ok") == 1
    for route, arm in (("pool", "stable"), (backup.name, "none")):
        assert value(samples, "ragsite_generation_duration_seconds_count", route=route, arm=arm) == 1
        assert value(samples, "ragsite_generation_time_to_first_token_seconds_count", route=route, arm=arm) == 1
        assert value(samples, "ragsite_generation_tokens_total", route=route, arm=arm, kind="prompt") > 0
        assert value(samples, "ragsite_generation_tokens_total", route=route, arm=arm, kind="completion") > 0
    assert value(samples, "ragsite_generation_tokens_total", route="pool", arm="stable", kind="completion") == 12
    # Speculative decoding under vLLM's names, from the engine's per-request figures: the
    # engine's own counters moved by as much, and an identical draft has every proposal accepted.
    drafts = value(samples, "vllm:spec_decode_num_drafts_total", model_name=target)
    proposed = value(samples, "vllm:spec_decode_num_draft_tokens_total", model_name=target)
    accepted = value(samples, "vllm:spec_decode_num_accepted_tokens_total", model_name=target)
    assert drafts > 0 and proposed > 0 and accepted == proposed
    assert drafts == engine_moved["vllm:spec_decode_num_drafts_total"]
    assert proposed == engine_moved["vllm:spec_decode_num_draft_tokens_total"]
    assert accepted == engine_moved["vllm:spec_decode_num_accepted_tokens_total"]
    per_position = {
        dict(key)["position"]: count
        for key, count in samples["vllm:spec_decode_num_accepted_tokens_per_pos_total"].items()
    }
    assert set(per_position) == {"0", "1", "2", "3"} and sum(per_position.values()) == accepted
    assert all(count == engine_moved[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{position}]"]
               for position, count in per_position.items())  # fmt: skip

    # Routing: one retry and one failover away from the failing route; keys per provider and state.
    assert samples["ragsite_router_retries_total"] == {(("route", remote.name),): 1.0}
    assert samples["ragsite_router_failovers_total"] == {(("route", remote.name),): 1.0}
    for provider in (failing.name, backup.provider.name):
        assert value(samples, "ragsite_upstream_keys", provider=provider, state="active") == 1
        assert value(samples, "ragsite_upstream_keys", provider=provider, state="disabled") == 0
    assert value(samples, "ragsite_canary_percent", release="next", route=backup.name) == 0
    assert value(samples, "ragsite_canary_state", release="next", state="running") == 1
    assert value(samples, "ragsite_canary_state", release="next", state="rolled_back") == 0
    assert value(samples, "ragsite_canary_rollbacks_total", release="next") == 0

    # Billing, this month: the local pool is priced ("local"), the stand-in's model is not.
    month = time.strftime("%Y-%m", time.gmtime())
    costs = {dict(key)["model"]: cost for key, cost in samples["ragsite_cost_usd"].items()}
    assert {dict(key)["month"] for key in samples["ragsite_cost_usd"]} == {month}
    assert set(costs) == {target, "stand-in-7b", "all-MiniLM-L6-v2"}
    assert costs[target] > 0 and costs["stand-in-7b"] == 0
    assert samples["ragsite_client_key_budget_used_ratio"] == {(("key", budgeted.prefix),): 0.0}

    # Celery: nothing left waiting; the one worker consumes gpu, remote and default.
    assert label_values(samples, "ragsite_celery_queue_length", "queue") == {"ingest", "gpu", "remote", "default"}
    # Each generation queue's bound now: at least GENERATION_QUEUE_MAX; more at its workers' rate.
    for queue in ("gpu", "remote"):
        rate = value(samples, "ragsite_generation_queue_drain_rate", queue=queue)
        bound = max(settings.GENERATION_QUEUE_MAX, int(rate * settings.GENERATION_QUEUE_MAX_WAIT_S))
        assert value(samples, "ragsite_generation_queue_bound", queue=queue) == bound
    assert samples["ragsite_celery_workers"] == {
        (("queue", "ingest"),): 1.0,
        (("queue", "gpu"),): 1.0,
        (("queue", "remote"),): 1.0,
        (("queue", "default"),): 1.0,
    }


def test_metrics_need_the_token_in_production_and_are_never_public_by_accident():
    client = Client()
    with override_settings(PRODUCTION=True, METRICS_TOKEN=""):
        assert client.get("/metrics").status_code == 404
        assert client.get("/metrics", headers={"Authorization": "Bearer anything"}).status_code == 404
    with override_settings(PRODUCTION=True, METRICS_TOKEN="s3cret-metrics-token"):
        assert client.get("/metrics").status_code == 401
        refused = client.get("/metrics", headers={"Authorization": "Bearer wrong"})
        assert refused.status_code == 401 and refused["WWW-Authenticate"].startswith("Bearer")
        served = client.get("/metrics", headers={"Authorization": "Bearer s3cret-metrics-token"})
        assert served.status_code == 200
        assert "ragsite_documents" in scrape(served.content.decode())
    with override_settings(PRODUCTION=False, METRICS_TOKEN=""):
        assert client.get("/metrics").status_code == 200


def test_a_scrape_with_redis_unreachable_leaves_out_only_the_queue_lengths(caplog):
    with override_settings(REDIS_URL="redis://127.0.0.1:9/0"):  # nothing listens on port 9
        response = Client().get("/metrics")
    assert response.status_code == 200
    samples = scrape(response.content.decode())
    text = response.content.decode()
    assert "ragsite_celery_queue_length" not in text
    # The other families are there, from PostgreSQL and the broadcast (no worker here).
    assert value(samples, "ragsite_documents", status="indexed") == 0
    assert "# TYPE ragsite_upstream_keys gauge" in text and "# TYPE ragsite_cost_usd gauge" in text
    assert value(samples, "ragsite_celery_workers", queue="gpu") == 0
    assert "metrics: queue_lengths skipped in this scrape" in caplog.text
