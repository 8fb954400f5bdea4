"""The router's per-process route cache (inference/router.py) against PostgreSQL's routing
version (triggers in migration inference 0002): a repeated plan reads one number, and every
change a plan depends on is seen by the next plan, whoever made it (the ORM, a bulk
``update``, the key pool, another connection), while a key's ordinary use changes nothing.
"""

from __future__ import annotations

import time
from datetime import timedelta
from decimal import Decimal
from types import SimpleNamespace

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from inference import keypool, router
from inference.errors import RouteNotFound, RouteUnavailable
from inference.models import CanaryRelease, Provider, Route, RoutingVersion, UpstreamKey
from tests.conftest import database_url_for_current_test_db
from tests.inference.routing_helpers import key_make, provider_make, route_make

pytestmark = pytest.mark.django_db(transaction=True)

BASE_URL = "http://127.0.0.1:9/v1"  # never called: these tests only plan


def version() -> int:
    return RoutingVersion.objects.get(id=1).version


def plan_queries(monkeypatch, **kwargs) -> tuple[router.Plan, list[str]]:
    """The plan and the statements it sent (all of them: Django counts them too)."""
    sent = []
    fetch_one = router.fetch_one

    def recording(sql, params):
        sent.append(sql)
        return fetch_one(sql, params)

    with monkeypatch.context() as patch, CaptureQueriesContext(connection) as queries:
        patch.setattr(router, "fetch_one", recording)
        plan = router.plan(**kwargs)
    assert len(queries.captured_queries) == len(sent)
    return plan, sent


def test_a_repeated_plan_reads_only_the_routing_version(monkeypatch):
    provider = provider_make(BASE_URL)
    key_make(provider)
    route = route_make(provider)

    first, first_sql = plan_queries(monkeypatch, route_name=route.name)
    second, second_sql = plan_queries(monkeypatch, route_name=route.name)

    assert len(first_sql) == 1 and "inference_canaryrelease" in first_sql[0]
    assert second_sql == ["SELECT (SELECT version FROM inference_routingversion WHERE id = 1)"]
    assert (second.route.id, second.key_usable, second.arm) == (route.id, True, "")
    assert first.request_id != second.request_id


def test_using_a_key_leaves_the_version_and_a_cooldown_moves_it():
    provider = provider_make(BASE_URL)
    key, _ = key_make(provider)
    before = version()

    assert keypool.upstream_key_pick(provider.id).id == key.id
    keypool.upstream_key_succeeded(key.id)
    assert version() == before

    keypool.upstream_key_failed(
        key.id, kind="rate_limited", message="429", provider_name=provider.name, retry_after_s=30
    )
    after_cooldown = version()
    assert after_cooldown > before
    keypool.upstream_key_failed(key.id, kind="server_error", message="500", provider_name=provider.name)
    assert version() == after_cooldown  # counted, but the key is as usable as it was


def test_every_kind_of_change_reaches_the_next_plan(monkeypatch):
    provider = provider_make(BASE_URL)
    key_make(provider)
    route = route_make(provider)
    canary_provider = provider_make(BASE_URL)
    key_make(canary_provider)
    canary_route = route_make(canary_provider)
    assert router.plan(route_name=route.name).release is None

    # A release created through the ORM.
    release = CanaryRelease.objects.create(
        name="cache", stable_route=route, canary_route=canary_route, percent=Decimal("100")
    )
    plan = router.plan(route_name=route.name, client_id="someone")
    assert (plan.release.id, plan.arm, plan.route.id) == (release.id, "canary", canary_route.id)

    # A bulk update (no signals, no save()).
    CanaryRelease.objects.filter(id=release.id).update(percent=Decimal("0"))
    plan = router.plan(route_name=route.name, client_id="someone")
    assert (plan.arm, plan.route.id) == ("stable", route.id)

    # Every key of the route's provider cooling down, set in bulk: the plan knows at once.
    UpstreamKey.objects.filter(provider=provider).update(
        status=UpstreamKey.Status.COOLING_DOWN, cooldown_until=timezone.now() + timedelta(seconds=60)
    )
    plan = router.plan(route_name=route.name, client_id="someone")
    assert plan.key_usable is False
    with pytest.raises(RouteUnavailable) as unavailable:
        router.check_available(plan.route, key_usable=plan.key_usable)
    assert 59 < unavailable.value.retry_after_s <= 60
    # Once the cooldowns end, the plan says usable with nothing changed in the database:
    # the cached entry holds when the first cooldown ends.
    later = time.time() + 61
    with monkeypatch.context() as patch:
        patch.setattr(router, "time", SimpleNamespace(time=lambda: later))
        assert router.plan(route_name=route.name).key_usable is True

    # Cooldowns that have ended: usable again (a cooling key past its end is usable as it is).
    UpstreamKey.objects.filter(provider=provider).update(cooldown_until=timezone.now() - timedelta(seconds=1))
    assert router.plan(route_name=route.name).key_usable is True

    # A change from another connection (another process), in plain SQL.
    with psycopg.connect(database_url_for_current_test_db(), autocommit=True) as other:
        other.execute("UPDATE inference_route SET enabled = false WHERE id = %s", [route.id])
    with pytest.raises(RouteNotFound):
        router.plan(route_name=route.name)
    Route.objects.filter(id=route.id).update(enabled=True)

    # The provider renamed through save().
    provider.name = "renamed-upstream"
    provider.save()
    assert router.plan(route_name=route.name).route.provider.name == "renamed-upstream"
    Provider.objects.filter(id=provider.id).update(enabled=False)
    with pytest.raises(RouteNotFound):
        router.plan(route_name=route.name)


def test_an_emptied_version_table_disables_the_cache_without_serving_stale_routes():
    provider = provider_make(BASE_URL)
    key_make(provider)
    route = route_make(provider)
    router.plan(route_name=route.name)
    RoutingVersion.objects.all().delete()

    route.max_tokens = 17
    route.save()  # the trigger writes a new, never used, version
    assert router.plan(route_name=route.name).route.max_tokens == 17
    assert version() > 0
