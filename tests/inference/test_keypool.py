"""The upstream key pool against the OpenAI-protocol stand-in (a real process) and PostgreSQL.

Requests run through ``inference.execution.run_routed`` in this process (what the
``remote`` worker runs), the official ``openai`` client underneath; the stand-in's
per-key log says which key each request really used. The pool's statements commit on
their own, as in a worker, hence ``transaction=True``.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import psycopg
import pytest
from django.utils import timezone

from inference import keypool, router
from inference.errors import RouteUnavailable
from inference.models import Provider, UpstreamKey
from tests.conftest import database_url_for_current_test_db
from tests.inference.routing_helpers import (
    WORDS,
    deltas,
    key_make,
    provider_make,
    route_make,
    routed,
    unique,
)
from tests.upstream_server import upstream_log, upstream_script

pytestmark = pytest.mark.django_db(transaction=True)


def seen_at(base_url: str, secret: str) -> list[float]:
    return [entry["time"] for entry in upstream_log(base_url, secret)]


# --------------------------------------------------------------------------- rotation


def test_rotation_is_least_recently_used_across_three_keys(upstream_server):
    provider = provider_make(upstream_server)
    keys = [key_make(provider, label) for label in ("a", "b", "c")]
    route = route_make(provider)

    results = [routed(route)[0] for _ in range(6)]

    assert [result["status"] for result in results] == ["ok"] * 6
    # Which key each request used, in arrival order at the stand-in.
    arrivals = sorted(
        (when, label)
        for (_, secret), label in zip(keys, "abc", strict=True)
        for when in seen_at(upstream_server, secret)
    )
    assert [label for _, label in arrivals] == list("abcabc")
    for row, _ in keys:
        row.refresh_from_db()
        assert (row.success_count, row.consecutive_failures, row.status) == (2, 0, UpstreamKey.Status.ACTIVE)
        assert row.last_used_at is not None
    # The next pick is the least recently used: a, whose last use is the oldest.
    assert keypool.upstream_key_pick(provider.id).id == keys[0][0].id


def test_a_pick_skips_a_key_another_transaction_holds_and_waits_when_all_are_held(upstream_server):
    provider = provider_make(upstream_server)
    first, _ = key_make(provider, "first")
    second, _ = key_make(provider, "second")
    url = database_url_for_current_test_db()

    with psycopg.connect(url) as other:  # holds the least recently used key's row
        other.execute("SELECT id FROM inference_upstreamkey WHERE id = %s FOR UPDATE", [first.id])
        assert keypool.upstream_key_pick(provider.id).id == second.id

    # Every usable row held: the pick still answers, with the least recently used key, once
    # the holder lets go (no "no key" while keys exist).
    held, release = threading.Event(), threading.Event()

    def hold_all():
        with psycopg.connect(url) as other:
            other.execute("SELECT id FROM inference_upstreamkey WHERE provider_id = %s FOR UPDATE", [provider.id])
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_all)
    holder.start()
    try:
        assert held.wait(10)
        threading.Timer(0.3, release.set).start()
        assert keypool.upstream_key_pick(provider.id).id == first.id
    finally:
        release.set()
        holder.join(10)


def test_exclude_skips_keys_and_none_is_returned_when_nothing_is_usable(upstream_server):
    provider = provider_make(upstream_server)
    first, _ = key_make(provider, "first")
    second, _ = key_make(provider, "second")
    assert keypool.upstream_key_pick(provider.id, exclude={first.id}).id == second.id
    assert keypool.upstream_key_pick(provider.id, exclude={first.id, second.id}) is None
    UpstreamKey.objects.filter(id=first.id).update(status=UpstreamKey.Status.DISABLED)
    UpstreamKey.objects.filter(id=second.id).update(
        status=UpstreamKey.Status.COOLING_DOWN, cooldown_until=timezone.now() + timedelta(seconds=30)
    )
    assert keypool.upstream_key_pick(provider.id) is None


# --------------------------------------------------------------------------- rate limits


def test_a_429_with_retry_after_ms_cools_the_key_until_then(upstream_server):
    provider = provider_make(upstream_server)
    limited, limited_secret = key_make(provider, "a")
    _, spare_secret = key_make(provider, "b")
    route = route_make(provider)
    upstream_script(upstream_server, limited_secret, [{"status": 429, "retry_after_ms": 1500}])

    result, events, usage = routed(route)
    returned = time.time()

    assert result["status"] == "ok" and deltas(events) == WORDS
    [refused] = upstream_log(upstream_server, limited_secret)
    assert refused["outcome"] == "status 429"
    limited.refresh_from_db()
    assert limited.status == UpstreamKey.Status.COOLING_DOWN
    assert (limited.consecutive_failures, limited.failure_count) == (1, 1)
    assert "429" in limited.last_error and limited.last_failure_at is not None
    # Until 1.5 s (the header's 1500 ms, not 1.5 ms nor 1,500 s) after the moment the pool
    # heard of the refusal, which lies between the stand-in's answer and our call's return.
    until = limited.cooldown_until.timestamp()
    assert refused["finished"] + 1.5 - 0.05 <= until <= returned + 1.5 + 0.05, (refused["finished"], until, returned)
    # The refused request went on at once with the other key: a retry event without a wait.
    [retry] = [data for kind, data in events if kind == "retry"]
    assert (retry["kind"], retry["status"], retry["retry_after_s"], retry["wait_s"]) == ("rate_limited", 429, 1.5, 0)
    assert usage.attempts == 2

    # Not used while it cools...
    for _ in range(2):
        assert routed(route)[0]["status"] == "ok"
    assert len(upstream_log(upstream_server, limited_secret)) == 1
    assert len(upstream_log(upstream_server, spare_secret)) == 3

    # ...and used again once the cooldown has passed (it is the least recently used).
    time.sleep(max(0.0, limited.cooldown_until.timestamp() - time.time()) + 0.1)
    assert routed(route)[0]["status"] == "ok"
    _, again = upstream_log(upstream_server, limited_secret)
    assert again["time"] >= limited.cooldown_until.timestamp() and again["outcome"] == "ok"
    limited.refresh_from_db()
    assert (limited.status, limited.cooldown_until, limited.consecutive_failures) == ("active", None, 0)


def test_a_429_without_a_header_cools_exponentially(upstream_server, settings):
    settings.UPSTREAM_KEY_COOLDOWN_BASE_S = 0.5
    settings.UPSTREAM_KEY_COOLDOWN_MAX_S = 60
    provider = provider_make(upstream_server)
    limited, secret = key_make(provider, "a")
    key_make(provider, "b")
    route = route_make(provider)
    upstream_script(upstream_server, secret, [{"status": 429}, {"status": 429}])

    # 0.5 s after the first refusal, twice that after the second in a row: the cooldown's end
    # lies that long after a moment between the stand-in's answer and our call's return.
    for expected in (0.5, 1.0):
        assert routed(route)[0]["status"] == "ok"
        returned = time.time()
        limited.refresh_from_db()
        refused = upstream_log(upstream_server, secret)[-1]
        assert refused["outcome"] == "status 429"
        until = limited.cooldown_until.timestamp()
        assert refused["finished"] + expected - 0.05 <= until <= returned + expected + 0.05, (expected, until)
        time.sleep(max(0.0, until - time.time()) + 0.1)
    assert limited.consecutive_failures == 2


def test_the_exponential_cooldown_is_capped(upstream_server, settings):
    settings.UPSTREAM_KEY_COOLDOWN_BASE_S = 1
    settings.UPSTREAM_KEY_COOLDOWN_MAX_S = 3
    provider = provider_make(upstream_server)
    key, _ = key_make(provider)
    UpstreamKey.objects.filter(id=key.id).update(consecutive_failures=40)
    before = time.time()
    state = keypool.upstream_key_failed(key.id, kind="rate_limited", message="HTTP 429", provider_name=provider.name)
    assert state.status == "cooling_down" and state.consecutive_failures == 41
    assert 2.9 <= state.cooldown_until.timestamp() - before <= 3.5


# --------------------------------------------------------------------------- rejected keys


def test_a_401_disables_the_key_with_the_reason_and_it_is_never_used_again(upstream_server):
    provider = provider_make(upstream_server)
    revoked, revoked_secret = key_make(provider, "revoked")
    _, good_secret = key_make(provider, "good")
    route = route_make(provider)
    upstream_script(upstream_server, revoked_secret, [{"status": 401, "repeat": True}])

    results = [routed(route)[0] for _ in range(4)]

    assert [result["status"] for result in results] == ["ok"] * 4
    assert [result["attempts"] for result in results] == [2, 1, 1, 1]
    assert len(upstream_log(upstream_server, revoked_secret)) == 1
    assert len(upstream_log(upstream_server, good_secret)) == 4
    revoked.refresh_from_db()
    assert revoked.status == UpstreamKey.Status.DISABLED and revoked.cooldown_until is None
    reason = revoked.disabled_reason
    assert provider.name in reason and "HTTP 401" in reason and "re-enable it here" in reason
    assert revoked_secret not in reason and revoked_secret not in revoked.last_error
    assert keypool.upstream_key_pick(provider.id, exclude=set()) is not None  # the good one

    # An operator re-enables it (the admin sets the status): it is in the rotation again.
    upstream_script(upstream_server, revoked_secret, [])
    UpstreamKey.objects.filter(id=revoked.id).update(status=UpstreamKey.Status.ACTIVE, disabled_reason="")
    assert routed(route)[0]["status"] == "ok"
    assert [entry["outcome"] for entry in upstream_log(upstream_server, revoked_secret)] == ["status 401", "ok"]


def test_a_403_disables_the_key_too(upstream_server):
    provider = provider_make(upstream_server)
    denied, secret = key_make(provider, "denied")
    key_make(provider, "good")
    upstream_script(upstream_server, secret, [{"status": 403}])
    assert routed(route_make(provider))[0]["status"] == "ok"
    denied.refresh_from_db()
    assert denied.status == "disabled" and "HTTP 403" in denied.disabled_reason


def test_failures_count_and_a_success_resets_the_streak(upstream_server, settings):
    settings.ROUTER_BACKOFF_BASE_S = 0.01
    settings.ROUTER_BACKOFF_MAX_S = 0.05
    provider = provider_make(upstream_server)
    key, secret = key_make(provider)
    route = route_make(provider)
    upstream_script(upstream_server, secret, [{"status": 500}, {"status": 502}])

    routed(route)
    key.refresh_from_db()
    assert (key.failure_count, key.consecutive_failures, key.success_count) == (2, 0, 1)
    assert "HTTP 502" in key.last_error and key.status == "active"


def test_decrypted_secrets_are_cached_per_key_and_ciphertext(upstream_server, monkeypatch):
    provider = provider_make(upstream_server)
    key, secret = key_make(provider)
    calls = []
    real = keypool.decrypt
    monkeypatch.setattr(keypool, "decrypt", lambda token: calls.append(token) or real(token))
    keypool.plaintext.cache_clear()
    picked = [keypool.upstream_key_pick(provider.id) for _ in range(3)]
    assert [p.secret() for p in picked] == [secret] * 3
    assert len(calls) == 1
    # A replaced secret is a new entry.
    key.set_secret(secret + "-new")
    key.save()
    assert keypool.upstream_key_pick(provider.id).secret() == secret + "-new"
    assert len(calls) == 2


def test_a_key_that_cannot_be_decrypted_is_disabled_and_the_next_one_serves(upstream_server):
    provider = provider_make(upstream_server)
    broken, _ = key_make(provider, "broken")
    _, good_secret = key_make(provider, "good")
    UpstreamKey.objects.filter(id=broken.id).update(secret_encrypted="gAAAAA-not-a-token")
    result, _, usage = routed(route_make(provider))
    assert result["status"] == "ok" and usage.attempts == 1
    broken.refresh_from_db()
    assert broken.status == "disabled" and "UPSTREAM_KEY_ENCRYPTION_KEYS" in broken.disabled_reason
    assert len(upstream_log(upstream_server, good_secret)) == 1


# --------------------------------------------------------------------------- availability


def _cool(key: UpstreamKey, seconds: float) -> None:
    UpstreamKey.objects.filter(id=key.id).update(
        status=UpstreamKey.Status.COOLING_DOWN, cooldown_until=timezone.now() + timedelta(seconds=seconds)
    )


def _plan(route):
    return router.plan(route_name=route.name, client_id="tests")


def test_submit_refuses_with_retry_after_when_every_key_is_cooling_down(upstream_server, monkeypatch):
    sent = []
    monkeypatch.setattr("inference.tasks.generate_routed.apply_async", lambda *a, **k: sent.append((a, k)))
    provider = provider_make(upstream_server)
    first, _ = key_make(provider, "a")
    second, _ = key_make(provider, "b")
    fallback_provider = provider_make(upstream_server)
    fallback_key, _ = key_make(fallback_provider)
    route = route_make(provider, fallbacks=(route_make(fallback_provider),))
    _cool(first, 30)
    _cool(second, 45)
    _cool(fallback_key, 20)

    with pytest.raises(RouteUnavailable) as refused:
        router.submit(_plan(route), messages=[{"role": "user", "content": "hi"}])

    assert 19 <= refused.value.retry_after_s <= 20  # the earliest key back: the fallback's
    message = str(refused.value)
    assert route.name in message and provider.name in message and fallback_provider.name in message
    assert "cooling down" in message
    assert sent == []

    # One key of the fallback back: the request goes out.
    UpstreamKey.objects.filter(id=fallback_key.id).update(status="active", cooldown_until=None)
    router.submit(_plan(route), messages=[{"role": "user", "content": "hi"}])
    assert len(sent) == 1 and sent[0][1]["queue"] == "remote"


def test_submit_says_which_provider_has_no_key_or_only_rejected_ones(upstream_server, monkeypatch):
    monkeypatch.setattr("inference.tasks.generate_routed.apply_async", lambda *a, **k: None)
    keyless = provider_make(upstream_server)
    with pytest.raises(RouteUnavailable) as refused:
        router.submit(_plan(route_make(keyless)), messages=[{"role": "user", "content": "hi"}])
    assert refused.value.retry_after_s is None
    assert f"provider {keyless.name} has no upstream key: add one in the admin" in str(refused.value)

    rejected = provider_make(upstream_server)
    key, _ = key_make(rejected)
    UpstreamKey.objects.filter(id=key.id).update(status="disabled", disabled_reason="HTTP 401")
    with pytest.raises(RouteUnavailable) as refused:
        router.submit(_plan(route_make(rejected)), messages=[{"role": "user", "content": "hi"}])
    assert refused.value.retry_after_s is None
    assert "1 disabled" in str(refused.value) and "re-enable" in str(refused.value)


def test_a_local_fallback_keeps_the_route_available(upstream_server, monkeypatch):
    sent = []
    monkeypatch.setattr("inference.tasks.generate_routed.apply_async", lambda *a, **k: sent.append((a, k)))
    remote = provider_make(upstream_server)
    local = Provider.objects.create(
        name=unique("local"), kind=Provider.Kind.LOCAL, devices=["http://127.0.0.1:9/v1"], model="tiny"
    )
    route = route_make(remote, fallbacks=(route_make(local),))
    plan = _plan(route)
    router.submit(plan, messages=[{"role": "user", "content": "hi"}])  # no key, but the pool needs none
    # The route's own queue: the worker hands over to gpu when it reaches the pool.
    [((request_id, payload), options)] = [(args[0], options) for args, options in sent]
    assert (request_id, payload["route_id"], options["queue"]) == (plan.request_id, route.id, "remote")
    # Without the local fallback, the same keyless provider is refused before anything is queued.
    bare = route_make(remote)
    with pytest.raises(RouteUnavailable) as refused:
        router.submit(_plan(bare), messages=[{"role": "user", "content": "hi"}])
    assert refused.value.retry_after_s is None  # no key comes back by itself
    assert len(sent) == 1


def test_availability_is_one_query(upstream_server, django_assert_num_queries):
    provider = provider_make(upstream_server)
    key_make(provider)
    route = route_make(provider, fallbacks=(route_make(provider_make(upstream_server)),))
    with django_assert_num_queries(1):
        available = keypool.availability(route_id=route.id)
    assert (available.usable, available.keys, len(available.providers)) == (1, 1, 2)
    with django_assert_num_queries(1):
        keypool.upstream_key_pick(provider.id)
