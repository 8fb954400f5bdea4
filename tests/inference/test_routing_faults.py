"""Retries, caps and failover of routed generations, against the OpenAI-protocol stand-in.

Most tests run ``run_routed`` (the body of ``generate_routed``) in this process with
faults scripted per API key; the last ones go through real worker processes (``remote``
and ``gpu``, both threads) and a GPU pool whose device is a real engine server (our engine
behind the OpenAI protocol, ``python -m inference.engine.server``): hand-overs both ways
between an upstream's route and the pool's. Assertions are on what the stand-in and the
engine received, the stream's events and the ledger; times only as generous bounds.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from decimal import Decimal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing.models import UsageRecord
from inference import canary, pool, router
from inference.engine.models import models_load
from inference.engine.speculative import GenerationRequest, GenerationStats, SpeculativeConfig, generate
from inference.errors import RouteNotFound, RouteUnavailable
from inference.execution import run_routed
from inference.models import CanaryRelease, Provider, Route, UpstreamKey
from inference.streams import StreamWriter, stream_key
from tests.inference.routing_helpers import (
    REPLY,
    WORDS,
    deltas,
    events_of,
    key_make,
    kinds,
    ledger_row,
    payload,
    provider_make,
    route_make,
    routed,
    unique,
)
from tests.inference.tiny_models import tiny_model_save
from tests.pools import closed_device, engine_serving
from tests.upstream_server import upstream_log, upstream_script

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def quick_backoff(settings):
    settings.ROUTER_BACKOFF_BASE_S = 0.1
    settings.ROUTER_BACKOFF_MAX_S = 0.3
    return settings


def retries(events):
    return [data for kind, data in events if kind == "retry"]


# --------------------------------------------------------------------------- retries


def test_two_server_errors_then_success_take_three_attempts_with_bounded_backoff(upstream_server, quick_backoff):
    provider = provider_make(upstream_server)
    key, secret = key_make(provider)
    upstream_script(upstream_server, secret, [{"status": 500}, {"status": 503}])

    result, events, usage = routed(route_make(provider))

    assert result["status"] == "ok" and result["attempts"] == 3
    assert kinds(events) == ["retry", "retry"] + ["delta"] * len(WORDS) + ["stats"]
    assert "".join(deltas(events)) == REPLY
    first, second = retries(events)
    assert [(r["attempt"], r["kind"], r["status"]) for r in (first, second)] == [
        (1, "server_error", 500),
        (2, "server_error", 503),
    ]
    # Full jitter: the n-th wait is drawn from [0, min(max, base * 2^(n-1))].
    assert 0 <= first["wait_s"] <= 0.1 and 0 <= second["wait_s"] <= 0.2
    log = upstream_log(upstream_server, secret)
    assert [entry["outcome"] for entry in log] == ["status 500", "status 503", "ok"]
    # The waits were really waited, between the stand-in's answer and the next request.
    for before, after, retry in zip(log, log[1:], (first, second), strict=False):
        assert after["time"] - before["finished"] >= retry["wait_s"] - 0.01
    assert events[-1][1]["attempts"] == 3
    assert (usage.status, usage.attempts, usage.upstream_key_id, usage.error_class) == ("ok", 3, key.id, "")
    assert usage.completion_tokens == len(WORDS) and usage.usage_source == "upstream"
    assert usage.ttft_ms is not None and usage.latency_ms >= usage.ttft_ms > 0


def test_attempts_stop_at_five(upstream_server, quick_backoff):
    assert quick_backoff.ROUTER_MAX_ATTEMPTS == 5  # the default
    provider = provider_make(upstream_server)
    _, secret = key_make(provider)
    upstream_script(upstream_server, secret, [{"status": 500, "repeat": True}])

    result, events, usage = routed(route_make(provider))

    assert len(upstream_log(upstream_server, secret)) == 5
    assert result["status"] == "error" and result["attempts"] == 5
    assert kinds(events) == ["retry"] * 4 + ["error"]
    error = events[-1][1]
    assert (error["kind"], error["status"], error["attempts"], error["tokens_sent"]) == ("server_error", 500, 5, 0)
    assert "gave up after 5 attempts" in error["message"]
    assert (usage.status, usage.attempts, usage.error_class, usage.completion_tokens) == ("error", 5, "server_error", 0)


def test_the_deadline_stops_retries_and_cuts_the_last_attempt(upstream_server, quick_backoff):
    quick_backoff.ROUTER_DEADLINE_S = 2.5
    provider = provider_make(upstream_server, first_token_timeout_s=1.0)
    _, secret = key_make(provider)
    upstream_script(upstream_server, secret, [{"first_byte_delay_ms": 4000, "repeat": True}])

    started = time.monotonic()
    result, events, usage = routed(route_make(provider))
    elapsed = time.monotonic() - started

    assert result["status"] == "error"
    assert 1 <= usage.attempts < 5  # two or three here: 1 s each, the last one cut to what is left
    assert len(upstream_log(upstream_server, secret)) == usage.attempts
    error = events[-1][1]
    assert error["kind"] == "timeout" and "ROUTER_DEADLINE_S=2.5 s" in error["message"]
    assert elapsed < 2.5 + 2  # stopped by the deadline (with slack for a slow machine), not after 5 attempts


def _pool_route(devices: list[str]) -> Route:
    provider = Provider.objects.create(
        name=unique("pool"),
        kind=Provider.Kind.LOCAL,
        devices=devices,
        model="stand-in-7b",
        first_token_timeout_s=1.0,
        total_timeout_s=30,
    )
    return route_make(provider)


def test_a_pool_attempt_that_timed_out_is_cancelled_before_its_retry(upstream_server, quick_backoff, settings):
    # The pool's key is the stand-in's script id: one of this test's own.
    settings.GPU_POOL_API_KEY = secret = f"pool-{uuid.uuid4().hex}"
    upstream_script(upstream_server, secret, [{"first_byte_delay_ms": 8000}])

    result, events, usage = routed(_pool_route([upstream_server]))

    first, second = upstream_log(upstream_server, secret)
    assert result["status"] == "ok" and "".join(deltas(events)) == REPLY
    # The engine saw the first attempt go (its connection closed: vLLM aborts such a
    # request) before the retry reached it, long before its 8 s would have passed.
    assert first["outcome"] == "client disconnected after 0 tokens" and first["disconnected"] is True
    assert first["finished"] <= second["time"] < first["time"] + 8
    assert [r["kind"] for r in retries(events)] == ["timeout"]
    assert (usage.attempts, usage.status, usage.completion_tokens) == (2, "ok", len(WORDS))


def test_a_pool_retries_a_timed_out_prompt_on_another_device(upstream_server, quick_backoff, settings):
    settings.GPU_POOL_API_KEY = secret = f"pool-{uuid.uuid4().hex}"
    # Two devices of one stand-in, told apart by their URLs' hosts.
    slow, other = upstream_server, upstream_server.replace("127.0.0.1", "localhost")
    upstream_script(upstream_server, secret, [{"first_byte_delay_ms": 8000}])

    result, events, _ = routed(_pool_route([slow, other]))

    first, second = upstream_log(upstream_server, secret)
    assert result["status"] == "ok" and "".join(deltas(events)) == REPLY
    # The first attempt went where the prompt's affinity led; the retry to the other device.
    assert {first["host"].split(":")[0], second["host"].split(":")[0]} == {"127.0.0.1", "localhost"}
    assert (first["disconnected"], second["outcome"]) == (True, "ok")


def test_a_bad_request_is_not_retried(upstream_server, quick_backoff):
    provider = provider_make(upstream_server)
    _, secret = key_make(provider, "a")
    _, other = key_make(provider, "b")
    upstream_script(upstream_server, secret, [{"status": 400}])

    _, events, usage = routed(route_make(provider))

    assert kinds(events) == ["error"] and events[0][1]["kind"] == "bad_request"
    assert events[0][1]["retryable"] is False
    assert len(upstream_log(upstream_server, secret)) == 1 and upstream_log(upstream_server, other) == []
    assert (usage.attempts, usage.error_class) == (1, "bad_request")


def test_a_stream_cut_after_three_tokens_is_not_restarted(upstream_server, quick_backoff):
    provider = provider_make(upstream_server)
    key, secret = key_make(provider, "a")
    _, spare = key_make(provider, "b")
    upstream_script(upstream_server, secret, [{"cut_after_tokens": 3}])

    result, events, usage = routed(route_make(provider))

    assert kinds(events) == ["delta"] * 3 + ["error"]
    assert deltas(events) == WORDS[:3]
    error = events[-1][1]
    assert (error["kind"], error["tokens_sent"], error["retryable"], error["attempts"]) == (
        "broken_stream",
        3,
        False,
        1,
    )
    assert "not retried" in error["message"]
    assert [entry["outcome"] for entry in upstream_log(upstream_server, secret)] == ["cut after 3 tokens"]
    assert upstream_log(upstream_server, spare) == []
    assert result["text"] == "".join(WORDS[:3])
    assert (usage.status, usage.error_class, usage.completion_tokens, usage.attempts) == (
        "error",
        "broken_stream",
        3,
        1,
    )
    assert usage.upstream_key_id == key.id and usage.prompt_tokens > 0  # the upstream read the prompt
    key.refresh_from_db()
    assert key.failure_count == 1


def test_a_short_retry_after_on_the_only_key_is_waited_for(upstream_server, settings):
    settings.ROUTER_BACKOFF_MAX_S = 2
    provider = provider_make(upstream_server)
    _, secret = key_make(provider)
    upstream_script(upstream_server, secret, [{"status": 429, "retry_after_ms": 300}])

    result, events, usage = routed(route_make(provider))

    assert result["status"] == "ok" and usage.attempts == 2
    [retry] = retries(events)
    assert retry["kind"] == "rate_limited" and 0 < retry["wait_s"] <= 0.32  # what was left of the 300 ms
    refused, served = upstream_log(upstream_server, secret)
    assert served["time"] - refused["finished"] >= 0.29


def test_every_key_cooling_for_long_ends_the_request_unavailable(upstream_server):
    provider = provider_make(upstream_server)
    first, secret = key_make(provider, "a")
    second, _ = key_make(provider, "b")
    now = time.time()
    for key, seconds in ((first, 30), (second, 45)):
        UpstreamKey.objects.filter(id=key.id).update(status="cooling_down", cooldown_until=_aware(now + seconds))

    _, events, usage = routed(route_make(provider))

    [(kind, error)] = events
    assert kind == "error" and error["kind"] == "unavailable"
    assert 28 <= error["retry_after_s"] <= 30
    assert provider.name in error["message"] and "cooling down" in error["message"]
    assert upstream_log(upstream_server, secret) == []
    assert (usage.status, usage.error_class, usage.attempts) == ("error", "unavailable", 0)


def _aware(timestamp: float):
    from datetime import UTC, datetime

    return datetime.fromtimestamp(timestamp, UTC)


# --------------------------------------------------------------------------- failover


def test_the_fallback_route_serves_when_the_primarys_keys_fail(upstream_server, quick_backoff):
    primary = provider_make(upstream_server)
    _, failing = key_make(primary, "failing")
    revoked, revoked_secret = key_make(primary, "revoked")
    upstream_script(upstream_server, failing, [{"status": 500, "repeat": True}])
    upstream_script(upstream_server, revoked_secret, [{"status": 401, "repeat": True}])
    backup = provider_make(upstream_server, model="backup-13b")
    backup_key, backup_secret = key_make(backup)
    fallback = route_make(backup)
    route = route_make(primary, fallbacks=(fallback,))

    result, events, usage = routed(route)

    # The 5xx moved on to the fallback at once (another key of a failing endpoint would
    # most likely fail alike); no backoff was needed.
    assert result["status"] == "ok" and result["route"] == fallback.name and result["provider"] == backup.name
    [retry] = retries(events)
    assert (retry["kind"], retry["route"], retry["wait_s"]) == ("server_error", fallback.name, 0)
    [served] = upstream_log(upstream_server, backup_secret)
    assert served["model"] == "backup-13b"
    assert (usage.attempts, usage.route_id, usage.provider_id, usage.upstream_key_id) == (
        2,
        fallback.id,
        backup.id,
        backup_key.id,
    )

    # Next request: the revoked key's turn (least recently used); it is disabled, the
    # failing one fails again, the fallback serves.
    result, events, usage = routed(route)
    assert result["status"] == "ok" and usage.attempts == 3
    assert [r["kind"] for r in retries(events)] == ["unauthorized", "server_error"]
    revoked.refresh_from_db()
    assert revoked.status == "disabled"

    # With every primary key disabled, requests go to the fallback directly.
    UpstreamKey.objects.filter(provider=primary).update(status="disabled")
    result, events, usage = routed(route)
    assert result["route"] == fallback.name and usage.attempts == 1 and retries(events) == []


def test_a_request_that_names_no_fallback_fails_with_the_primarys_error(upstream_server, quick_backoff):
    quick_backoff.ROUTER_MAX_ATTEMPTS = 2
    provider = provider_make(upstream_server)
    _, secret = key_make(provider)
    upstream_script(upstream_server, secret, [{"status": 502, "repeat": True}])
    result, events, _ = routed(route_make(provider))
    assert result["status"] == "error" and events[-1][1]["kind"] == "server_error"
    assert len(upstream_log(upstream_server, secret)) == 2


def test_a_local_fallback_is_handed_over_to_the_gpu_queue(upstream_server, quick_backoff):
    primary = provider_make(upstream_server)
    _, secret = key_make(primary)
    upstream_script(upstream_server, secret, [{"status": 500, "repeat": True}])
    local = route_make(
        Provider.objects.create(
            name=unique("pool"), kind=Provider.Kind.LOCAL, devices=["http://127.0.0.1:9/v1"], model="tiny"
        )
    )
    route = route_make(primary, fallbacks=(local,))
    request_id = uuid.uuid4().hex

    result = run_routed(request_id, payload(route))

    assert (result["status"], result["queue"]) == ("handed_over", "gpu")
    handover = result["payload"]["handover"]
    assert result["payload"]["route_id"] == local.id
    assert (handover["attempts"], handover["chain"], handover["events"]) == (1, [local.id], 1)
    assert handover["deadline"] > time.time() and handover["last_error"]["kind"] == "server_error"
    # The retry event announces where it goes; nothing is in the ledger yet.
    [(_, fields)] = StreamWriter(request_id).client.xrange(stream_key(request_id))
    assert fields[b"type"] == b"retry" and json.loads(fields[b"data"])["route"] == local.name
    assert not UsageRecord.objects.filter(request_id=request_id).exists()


# --------------------------------------------------------------------------- the plan


def test_the_plan_gives_each_client_the_arm_canary_arm_for_gives(upstream_server):
    stable = route_make(provider_make(upstream_server))
    key_make(stable.provider)
    candidate = route_make(provider_make(upstream_server))
    release = CanaryRelease.objects.create(
        name="plan", stable_route=stable, canary_route=candidate, percent=Decimal("30")
    )
    clients = [f"client-{n}" for n in range(200)]

    def arms():
        planned = [router.plan(route_name=stable.name, client_id=client) for client in clients]
        for plan, client in zip(planned, clients, strict=True):
            assert plan.release.id == release.id
            assert plan.arm == canary.arm_for(stable, client)[1]
            assert plan.route.id == (candidate.id if plan.arm == canary.CANARY else stable.id)
            # The key hint: the stable provider has a key, the canary's has none.
            assert plan.key_usable is (plan.arm != canary.CANARY)
        return [plan.arm for plan in planned]

    assert 0 < arms().count(canary.CANARY) < len(clients)
    CanaryRelease.objects.filter(id=release.id).update(state=CanaryRelease.State.PAUSED)
    assert 0 < arms().count(canary.CANARY) < len(clients)  # paused keeps its traffic
    Route.objects.filter(id=candidate.id).update(enabled=False)
    assert set(arms()) == {canary.STABLE}  # a disabled canary route serves no one
    CanaryRelease.objects.filter(id=release.id).update(state=CanaryRelease.State.ROLLED_BACK)
    plan = router.plan(route_name=stable.name, client_id="someone")
    assert (plan.release, plan.arm, plan.route.id) == (None, "", stable.id)


def test_a_named_route_that_does_not_exist_is_refused_with_the_names_there_are(upstream_server):
    route = route_make(provider_make(upstream_server))
    with pytest.raises(RouteNotFound) as refused:
        router.plan(route_name="no-such-route")
    assert route.name in str(refused.value)


# --------------------------------------------------------------------------- through workers


@pytest.mark.slow
def test_requests_fail_over_between_keys_through_a_remote_worker(start_worker, upstream_server):
    provider = provider_make(upstream_server)
    limited, limited_secret = key_make(provider, "a")
    spare, spare_secret = key_make(provider, "b")
    upstream_script(upstream_server, limited_secret, [{"status": 429, "retry_after_ms": 30000}])
    route = route_make(provider)
    messages = [{"role": "user", "content": f"REPLY: {REPLY}"}]

    with start_worker(["remote"], pool="threads", concurrency=4) as worker:
        plans, streams = [], []
        for n in range(3):  # one after the other, so that which key each one gets is certain
            plans.append(router.plan(route_name=route.name, client_id=f"client-{n}"))
            router.submit(plans[-1], messages=messages)
            streams.append(events_of(plans[-1].request_id, block_ms=60000))
        rows = [ledger_row(plan.request_id) for plan in plans]
        log = worker.log()

    for events in streams:
        assert kinds(events)[-1] == "stats" and "".join(deltas(events)) == REPLY
    assert [len(retries(events)) for events in streams] == [1, 0, 0]
    assert [row.attempts for row in rows] == [2, 1, 1]
    assert {row.upstream_key_id for row in rows} == {spare.id}
    assert len(upstream_log(upstream_server, limited_secret)) == 1
    assert len(upstream_log(upstream_server, spare_secret)) == 3
    assert UsageRecord.objects.filter(request_id__in=[p.request_id for p in plans]).count() == 3
    assert limited_secret not in log and spare_secret not in log
    # With the spare key cooling too, the web side refuses before enqueueing.
    UpstreamKey.objects.filter(id=spare.id).update(status="cooling_down", cooldown_until=_aware(time.time() + 60))
    limited.refresh_from_db()
    back_in = limited.cooldown_until.timestamp() - time.time()  # the first key back: the limited one
    with pytest.raises(RouteUnavailable) as refused:
        router.submit(router.plan(route_name=route.name), messages=messages)
    assert back_in - 1 <= refused.value.retry_after_s <= back_in


POOL_MODEL = "tiny-pool"
# It repeats itself: prompt lookup finds n-grams to propose from the first step on.
POOL_PROMPT = "the wing flow of the shock wave and the wing flow of the shock wave and the wing flow of the shock"


@pytest.fixture(scope="module")
def pool_engine(tmp_path_factory) -> dict:
    """One engine server speculating with n-grams (k=4) for a tiny model, as a pool device,
    and the engine's own greedy pieces for ``POOL_PROMPT`` (computed here: the exact reference)."""
    folder = tmp_path_factory.mktemp("routing-pool")
    model = tiny_model_save(folder / "model", 1)
    models = models_load(model, dtype="float32")
    request = GenerationRequest(
        prompt_ids=models.tokenizer.encode(POOL_PROMPT),  # no chat template: the contents, as the server does
        max_tokens=6,
        speculative=SpeculativeConfig(method="ngram", k=4),
    )
    pieces = list(generate(request, target=models.target, tokenizer=models.tokenizer))
    with engine_serving(model, folder / "engine.log", "--speculative", "ngram", "--k", "4", name=POOL_MODEL) as url:
        yield {"url": url, "pieces": [piece for piece in pieces[:-1] if piece], "stats": pieces[-1]}


def pool_make(*devices: str) -> Provider:
    return Provider.objects.create(
        name=unique("pool"),
        kind=Provider.Kind.LOCAL,
        devices=list(devices),
        model=POOL_MODEL,
        speculative_method="ngram",
        speculative_k=4,
        connect_timeout_s=2,
        first_token_timeout_s=30,
        total_timeout_s=60,
    )


def engine_counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{pool.server_root(url)}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
    )


def test_a_pool_serves_from_its_device_that_answers_and_reports_the_engines_speculation(pool_engine):
    device = pool_engine["url"]
    route = route_make(pool_make(closed_device(), device))
    proposed_before = engine_counter(device, "vllm:spec_decode_num_draft_tokens")

    result, events, usage = routed(route, POOL_PROMPT, max_tokens=6)

    assert isinstance(pool_engine["stats"], GenerationStats)
    assert result["status"] == "ok" and result["attempts"] == 1  # the closed device was passed over
    assert kinds(events) == ["delta"] * len(pool_engine["pieces"]) + ["stats"]
    assert deltas(events) == pool_engine["pieces"]
    stats = events[-1][1]
    assert (stats["completion_tokens"], stats["finish_reason"], stats["usage_source"], stats["model"]) == (
        6,
        "length",
        "upstream",
        POOL_MODEL,
    )
    spec = stats["speculative"]
    proposed = engine_counter(device, "vllm:spec_decode_num_draft_tokens") - proposed_before
    assert spec["draft_tokens_proposed"] == proposed > 0  # the engine's own count of this request
    assert (spec["spec_tokens"], len(spec["acceptance_histogram"]), sum(spec["acceptance_histogram"])) == (
        4,
        5,
        spec["spec_steps"],
    )
    assert (stats["draft_tokens_proposed"], stats["draft_tokens_accepted"]) == (
        spec["draft_tokens_proposed"],
        spec["draft_tokens_accepted"],
    )
    assert (usage.status, usage.attempts, usage.upstream_key_id, usage.usage_source, usage.completion_tokens) == (
        "ok",
        1,
        None,
        "upstream",
        6,
    )
    assert (usage.draft_tokens_proposed, usage.draft_tokens_accepted) == (
        spec["draft_tokens_proposed"],
        spec["draft_tokens_accepted"],
    )


@pytest.mark.slow
def test_hand_overs_between_an_upstream_and_a_pool_end_on_the_other_worker_with_one_ledger_row(
    start_worker, upstream_server, pool_engine
):
    # An upstream that fails, falling back to the pool (remote -> gpu).
    primary = provider_make(upstream_server)
    key, secret = key_make(primary)
    upstream_script(upstream_server, secret, [{"status": 500, "repeat": True}])
    local = route_make(pool_make(pool_engine["url"]))
    to_pool = route_make(primary, fallbacks=(local,))
    # A pool whose one device is down, falling back to a healthy upstream (gpu -> remote).
    backup = provider_make(upstream_server)
    backup_key, backup_secret = key_make(backup)
    upstream = route_make(backup)
    dark = route_make(pool_make(closed_device()), fallbacks=(upstream,))
    messages = [{"role": "user", "content": POOL_PROMPT}]
    to_pool_plan = router.plan(route_name=to_pool.name, client_id="someone")
    to_upstream_plan = router.plan(route_name=dark.name, client_id="someone")

    with (
        start_worker(["remote"], pool="threads", concurrency=2) as remote,
        start_worker(["gpu"], pool="threads", concurrency=4) as gpu,
    ):
        router.submit(to_pool_plan, messages=messages, max_tokens=6)
        router.submit(to_upstream_plan, messages=[{"role": "user", "content": f"REPLY: {REPLY}"}])
        to_pool_events = events_of(to_pool_plan.request_id, block_ms=120000)
        to_upstream_events = events_of(to_upstream_plan.request_id, block_ms=120000)
        to_pool_row = ledger_row(to_pool_plan.request_id)
        to_upstream_row = ledger_row(to_upstream_plan.request_id)
        logs = remote.log() + gpu.log()

    assert kinds(to_pool_events) == ["retry"] + ["delta"] * len(pool_engine["pieces"]) + ["stats"]
    assert deltas(to_pool_events) == pool_engine["pieces"]
    retry = to_pool_events[0][1]
    assert (retry["attempt"], retry["kind"], retry["route"]) == (1, "server_error", local.name)
    assert to_pool_events[-1][1]["attempts"] == 2 and to_pool_events[-1][1]["completion_tokens"] == 6
    assert len(upstream_log(upstream_server, secret)) == 1
    assert (to_pool_row.status, to_pool_row.attempts, to_pool_row.route_id, to_pool_row.upstream_key_id) == (
        "ok",
        2,
        local.id,
        None,
    )
    assert to_pool_row.completion_tokens == 6 and to_pool_row.usage_source == "upstream"
    key.refresh_from_db()
    assert key.failure_count == 1

    assert kinds(to_upstream_events) == ["retry"] + ["delta"] * len(WORDS) + ["stats"]
    assert "".join(deltas(to_upstream_events)) == REPLY
    retry = to_upstream_events[0][1]
    assert (retry["attempt"], retry["kind"], retry["route"]) == (1, "connection", upstream.name)
    assert (to_upstream_row.status, to_upstream_row.attempts, to_upstream_row.route_id) == ("ok", 2, upstream.id)
    assert to_upstream_row.upstream_key_id == backup_key.id
    assert len(upstream_log(upstream_server, backup_secret)) == 1

    for request_id in (to_pool_plan.request_id, to_upstream_plan.request_id):
        assert UsageRecord.objects.filter(request_id=request_id).count() == 1
    assert "interrupted" not in logs and secret not in logs and backup_secret not in logs
