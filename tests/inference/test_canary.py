"""Canary releases: sticky arms, operator actions with their history, and the analysis that
rolls a failing canary back (or promotes a healthy one), on real PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.urls import reverse
from django.utils.html import escape

from billing.models import UsageRecord
from inference import canary
from inference.models import CanaryEvent, CanaryRelease, Provider, Route
from tests.conftest import PROJECT_ROOT

Action = CanaryEvent.Action
State = CanaryRelease.State
WINDOW = 300


# -- arms ---------------------------------------------------------------------------------

ARMS_SCRIPT = """
import json, sys
from decimal import Decimal
import django
django.setup()
from inference.canary import arm_of
from inference.models import CanaryRelease
release = CanaryRelease(id=7, percent=Decimal("30"))
print(json.dumps([arm_of(release, f"user-{i}") for i in range(50)]))
"""


def arms_in_subprocess(hash_seed: str) -> list[str]:
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="ragsite.settings",
        CANARY_HASH_KEY=settings.CANARY_HASH_KEY,
        PYTHONHASHSEED=hash_seed,
    )
    result = subprocess.run(
        [sys.executable, "-c", ARMS_SCRIPT], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_same_client_gets_the_same_arm_in_another_process_whatever_the_hash_seed():
    release = CanaryRelease(id=7, percent=Decimal("30"))
    here = [canary.arm_of(release, f"user-{i}") for i in range(50)]
    assert set(here) == {canary.STABLE, canary.CANARY}  # a real split, not a constant
    assert arms_in_subprocess("0") == here
    assert arms_in_subprocess("12345") == here


def test_the_arm_depends_on_the_hash_key_and_the_release():
    ids = [f"user-{i}" for i in range(200)]
    buckets = [canary.bucket(7, client) for client in ids]
    assert [canary.bucket(8, client) for client in ids] != buckets
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(settings, "CANARY_HASH_KEY", "another key")
        assert [canary.bucket(7, client) for client in ids] != buckets


def test_canary_share_of_10000_clients_is_within_one_point_and_raising_only_moves_stable_to_canary(settings):
    # A fixed key: the test run's SECRET_KEY (and so the derived key) is random, and with
    # 10,000 clients the share's binomial spread at 50 % is 0.5 points, so 1 point is only
    # two standard deviations: an unpinned key would fail about one run in twenty.
    settings.CANARY_HASH_KEY = "canary-share-test-key"
    clients = [f"client-{i}" for i in range(10_000)]
    previous_canary: set[str] = set()
    for percent in ("0", "5", "25", "50", "100"):
        release = CanaryRelease(id=42, percent=Decimal(percent))
        on_canary = {client for client in clients if canary.arm_of(release, client) == canary.CANARY}
        share = 100 * len(on_canary) / len(clients)
        assert abs(share - float(percent)) <= 1.0, (percent, share)
        # Raising the percent only adds clients to the canary: nobody goes back to stable.
        assert previous_canary <= on_canary
        previous_canary = on_canary
    assert len(previous_canary) == 10_000


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture
def routes(db):
    old = Provider.objects.create(
        name="old",
        kind=Provider.Kind.LOCAL,
        devices=["http://127.0.0.1:9/v1"],
        model="tiny-old",
        context_window=2048,
    )
    new = Provider.objects.create(
        name="new", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://127.0.0.1:9/v1", model="new-model"
    )
    stable = Route.objects.create(name="default", provider=old, is_default=True, max_tokens=256)
    candidate = Route.objects.create(
        name="default-v2", provider=new, max_tokens=300, temperature=0.2, system_prompt="Answer briefly."
    )
    return stable, candidate


def start(routes, **options) -> CanaryRelease:
    stable, candidate = routes
    fields = {
        "name": "v2",
        "stable_route": stable,
        "canary_route": candidate,
        "percent": Decimal("25"),
        "step_percent": Decimal("10"),
        "window_seconds": WINDOW,
        "min_requests": 20,
        "max_error_rate": Decimal("0.05"),
        "failing_windows_to_rollback": 2,
        **options,
    }
    return canary.canary_release_start(**fields)


def ledger(release, arm, window_start, *, requests, errors=0, latency_ms=1000.0, ttft_ms=100.0):
    """``requests`` ledger rows for ``arm`` spread over the window starting at ``window_start``
    (the first ``errors`` of them failed). ``latency_ms``/``ttft_ms``: a value or a list."""

    def pick(value, i):
        return value[i] if isinstance(value, list) else value

    UsageRecord.objects.bulk_create(
        UsageRecord(
            release=release,
            arm=arm,
            kind=UsageRecord.Kind.GENERATION,
            status=UsageRecord.Status.ERROR if i < errors else UsageRecord.Status.OK,
            latency_ms=pick(latency_ms, i),
            ttft_ms=pick(ttft_ms, i),
            created_at=window_start + timedelta(seconds=(WINDOW - 1) * i / requests),
        )
        for i in range(requests)
    )


def window(release, k):
    """The start of the release's k-th window (0-based)."""
    return release.created_at + timedelta(seconds=WINDOW * k)


def end_of(release, k):
    return window(release, k + 1)


def actions(release) -> list[str]:
    return list(release.events.order_by("id").values_list("action", flat=True))


# -- operator actions ---------------------------------------------------------------------


def test_operator_actions_change_the_release_and_record_who_did_what(routes, django_user_model):
    operator = django_user_model.objects.create_user("operator")
    release = start(routes)
    assert (release.state, release.percent) == (State.RUNNING, Decimal("25.00"))

    release = canary.canary_release_percent_set(release, "40", actor=operator, reason="more traffic")
    release = canary.canary_release_step(release, actor=operator)
    assert release.percent == Decimal("50.00")
    release = canary.canary_release_pause(release, actor=operator)
    assert release.state == State.PAUSED
    with pytest.raises(canary.CanaryActionRefused, match="cannot pause"):
        canary.canary_release_pause(release)
    release = canary.canary_release_resume(release, actor=operator)
    with pytest.raises(canary.CanaryActionRefused, match="cannot resume"):
        canary.canary_release_resume(release)
    release = canary.canary_release_roll_back(release, "answers in the wrong language", actor=operator)
    assert (release.state, release.percent, release.ended_reason) == (
        State.ROLLED_BACK,
        Decimal("0"),
        "answers in the wrong language",
    )
    for action in (
        canary.canary_release_step,
        canary.canary_release_promote,
        canary.canary_release_pause,
        lambda r, **kw: canary.canary_release_percent_set(r, 5, **kw),
    ):
        with pytest.raises(canary.CanaryActionRefused, match="rolled back"):
            action(release)

    events = list(release.events.order_by("id").values_list("action", "percent_from", "percent_to", "actor", "reason"))
    assert events == [
        (Action.STARTED, None, Decimal("25.00"), None, ""),
        (Action.PERCENT_SET, Decimal("25.00"), Decimal("40.00"), operator.pk, "more traffic"),
        (Action.STEPPED, Decimal("40.00"), Decimal("50.00"), operator.pk, ""),
        (Action.PAUSED, Decimal("50.00"), Decimal("50.00"), operator.pk, ""),
        (Action.RESUMED, Decimal("50.00"), Decimal("50.00"), operator.pk, ""),
        (Action.ROLLED_BACK, Decimal("50.00"), Decimal("0.00"), operator.pk, "answers in the wrong language"),
    ]
    # Once rolled back, nobody is on the canary and the route has no live release.
    assert canary.arm_for(routes[0], "anyone") == (None, "")


def test_percent_is_validated(routes):
    release = start(routes)
    for bad in ("-1", "100.01", "lots"):
        with pytest.raises(canary.CanaryActionRefused, match="percent must be"):
            canary.canary_release_percent_set(release, bad)
    assert canary.canary_release_percent_set(release, "12.345").percent == Decimal("12.34")  # 0.01 steps


def test_set_percent_100_keeps_the_release_running(routes):
    release = canary.canary_release_percent_set(start(routes), 100)
    assert (release.state, release.percent) == (State.RUNNING, Decimal("100.00"))
    assert canary.arm_for(routes[0], "anyone") == (release, canary.CANARY)


def test_a_step_is_capped_at_100_and_reaching_it_promotes_the_canary_target_onto_the_stable_route(routes):
    stable, candidate = routes
    release = start(routes, percent=Decimal("95"))
    release = canary.canary_release_step(release)
    assert (release.state, release.percent) == (State.PROMOTED, Decimal("100"))
    stable.refresh_from_db()
    assert (stable.name, stable.is_default, stable.provider_id, stable.max_tokens, stable.temperature) == (
        "default",
        True,
        candidate.provider_id,
        300,
        0.2,
    )
    assert stable.system_prompt == "Answer briefly."
    event = release.events.get(action=Action.PROMOTED)
    assert (event.percent_from, event.percent_to) == (Decimal("95.00"), Decimal("100.00"))
    assert event.metrics["stable_route_before"]["provider"] == "old"
    assert event.metrics["stable_route_after"]["provider"] == "new"
    assert "route default now serves default-v2's target (new, new-model)" in release.ended_reason
    # The release has ended: every client is on the stable route, which runs the new version.
    assert canary.arm_for(stable, "anyone") == (None, "")


def test_only_one_live_release_per_stable_route(routes):
    start(routes)
    with pytest.raises(canary.CanaryActionRefused, match="already has a live release"):
        start(routes, name="v3")


def test_arm_for_uses_the_live_release_and_falls_back_to_stable_when_the_canary_is_disabled(routes):
    stable, candidate = routes
    release = start(routes, percent=Decimal("50"))
    arms = {canary.arm_for(stable, f"c{i}")[1] for i in range(100)}
    assert arms == {canary.STABLE, canary.CANARY}
    candidate.enabled = False
    candidate.save()
    assert {canary.arm_for(stable, f"c{i}") for i in range(100)} == {(release, canary.STABLE)}


@pytest.mark.django_db(transaction=True)
def test_an_operator_edit_waits_for_the_analysis_row_lock_and_loses_nothing(routes):
    release = start(routes)
    locked = threading.Event()
    release_lock = threading.Event()

    def analysis():
        try:
            with transaction.atomic():
                row = CanaryRelease.objects.select_for_update().get(pk=release.pk)
                locked.set()
                release_lock.wait(10)
                row.consecutive_failing_windows = 1
                row.last_analysis = {"verdict": "failing"}
                row.save()
        finally:
            connection.close()

    done = threading.Event()

    def operator():
        try:
            canary.canary_release_percent_set(release.pk, 60)
            done.set()
        finally:
            connection.close()

    threads = [threading.Thread(target=analysis)]
    threads[0].start()
    assert locked.wait(10)
    threads.append(threading.Thread(target=operator))
    threads[1].start()
    time.sleep(0.5)
    assert not done.is_set()  # the operator's change waits for the analysis's transaction
    release_lock.set()
    for thread in threads:
        thread.join(10)
    assert done.is_set()
    release.refresh_from_db()
    assert (release.percent, release.consecutive_failing_windows, release.last_analysis) == (
        Decimal("60.00"),
        1,
        {"verdict": "failing"},
    )


# -- analysis -----------------------------------------------------------------------------


def test_injected_canary_errors_roll_the_release_back_after_the_configured_windows(routes, admin_client):
    release = start(routes)
    for k in (0, 1):
        ledger(release, canary.STABLE, window(release, k), requests=120)
        ledger(release, canary.CANARY, window(release, k), requests=42, errors=13)

    # Nothing to judge before the first window has ended.
    assert canary.analyse_releases(now=end_of(release, 0) - timedelta(seconds=1)) == []

    [first] = canary.analyse_releases(now=end_of(release, 0) + timedelta(seconds=20))
    assert first["verdict"] == "failing"
    release.refresh_from_db()
    assert (release.state, release.percent, release.consecutive_failing_windows) == (State.RUNNING, 25, 1)
    assert release.last_analysis_at == end_of(release, 0)
    assert release.last_analysis["arms"]["canary"] == {
        "requests": 42,
        "errors": 13,
        "error_rate": 13 / 42,
        "p99_latency_ms": 1000.0,
        "p99_ttft_ms": 100.0,
    }
    assert release.last_analysis["arms"]["stable"]["requests"] == 120
    assert release.last_analysis["arms"]["stable"]["error_rate"] == 0.0
    # The same window is never judged twice.
    assert canary.analyse_releases(now=end_of(release, 0) + timedelta(seconds=80)) == []

    [second] = canary.analyse_releases(now=end_of(release, 1) + timedelta(seconds=5))
    assert second["action"] == "rolled_back"
    release.refresh_from_db()
    reason = "canary error rate 0.31 > 0.05 over 300 s (42 requests) in 2 consecutive windows"
    assert (release.state, release.percent, release.ended_reason) == (State.ROLLED_BACK, Decimal("0"), reason)
    assert actions(release) == [Action.STARTED, Action.WINDOW_FAILED, Action.WINDOW_FAILED, Action.ROLLED_BACK]
    assert release.events.get(action=Action.ROLLED_BACK).actor is None
    assert canary.arm_for(routes[0], "anyone") == (None, "")
    assert canary.analyse_releases(now=end_of(release, 5)) == []  # ended: no longer analysed

    page = admin_client.get(reverse("admin:inference_canaryrelease_change", args=[release.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert escape(reason) in html
    assert html.count("Window failed its thresholds") == 2
    assert "Rolled back" in html and "Started" in html
    assert escape("canary error rate 0.31 > 0.05 over 300 s (42 requests)") in html


def test_a_healthy_window_in_between_resets_the_count(routes):
    release = start(routes)
    for k, errors in enumerate([13, 0, 13, 13]):
        ledger(release, canary.STABLE, window(release, k), requests=50)
        ledger(release, canary.CANARY, window(release, k), requests=42, errors=errors)
    verdicts = [canary.analyse_releases(now=end_of(release, k))[0]["verdict"] for k in range(3)]
    assert verdicts == ["failing", "healthy", "failing"]
    release.refresh_from_db()
    assert (release.state, release.consecutive_failing_windows) == (State.RUNNING, 1)
    canary.analyse_releases(now=end_of(release, 3))
    release.refresh_from_db()
    assert release.state == State.ROLLED_BACK


def test_a_window_with_too_few_canary_requests_is_not_judged(routes):
    release = start(routes, failing_windows_to_rollback=1)
    ledger(release, canary.STABLE, window(release, 0), requests=100)
    ledger(release, canary.CANARY, window(release, 0), requests=19, errors=19)
    [result] = canary.analyse_releases(now=end_of(release, 0))
    assert result == {
        "release": release.pk,
        "verdict": "inconclusive",
        "action": "",
        "reasons": ["canary had 19 requests < 20 needed to judge"],
    }
    release.refresh_from_db()
    assert (release.state, release.consecutive_failing_windows) == (State.RUNNING, 0)
    assert actions(release) == [Action.STARTED]
    # One more canary request in the next window, and it is judged (and, at 1 window, rolled back).
    ledger(release, canary.CANARY, window(release, 1), requests=20, errors=20)
    canary.analyse_releases(now=end_of(release, 1))
    release.refresh_from_db()
    assert release.state == State.ROLLED_BACK
    assert release.ended_reason == "canary error rate 1 > 0.05 over 300 s (20 requests) in 1 window"


def test_a_window_without_canary_requests_is_never_judged_even_with_min_requests_0(routes):
    release = start(routes, min_requests=0, failing_windows_to_rollback=1)
    ledger(release, canary.STABLE, window(release, 0), requests=30)
    [result] = canary.analyse_releases(now=end_of(release, 0))
    assert (result["verdict"], result["reasons"]) == ("inconclusive", ["canary had 0 requests < 1 needed to judge"])


def test_a_slow_canary_fails_on_the_p99_latency_ratio(routes):
    release = start(routes, failing_windows_to_rollback=1)
    ledger(release, canary.STABLE, window(release, 0), requests=40, latency_ms=1000.0)
    # 100..10,000 ms: percentile_cont(0.99) = 9,900 + 0.01 x 100 = 9,901 ms.
    ledger(release, canary.CANARY, window(release, 0), requests=100, latency_ms=[100.0 * i for i in range(1, 101)])
    canary.analyse_releases(now=end_of(release, 0))
    release.refresh_from_db()
    assert release.last_analysis["arms"]["canary"]["p99_latency_ms"] == pytest.approx(9901.0)
    assert release.state == State.ROLLED_BACK
    assert release.ended_reason == (
        "canary p99 latency 9901 ms > 1.5 x stable 1000 ms (ratio 9.90) over 300 s (100 requests) in 1 window"
    )


def test_a_canary_slow_to_first_token_fails_on_the_ttft_ratio(routes):
    release = start(routes, failing_windows_to_rollback=1, max_ttft_ratio=Decimal("2"))
    ledger(release, canary.STABLE, window(release, 0), requests=40, ttft_ms=200.0)
    ledger(release, canary.CANARY, window(release, 0), requests=40, ttft_ms=401.0)
    canary.analyse_releases(now=end_of(release, 0))
    release.refresh_from_db()
    assert release.state == State.ROLLED_BACK
    assert release.ended_reason == (
        "canary p99 TTFT 401 ms > 2 x stable 200 ms (ratio 2.00) over 300 s (40 requests) in 1 window"
    )


def test_errors_count_in_the_error_rate_not_in_latency_and_ratios_need_a_stable_baseline(routes):
    release = start(routes, failing_windows_to_rollback=1)
    # One failed request that took 100 s, among 40 fast answers: 1/41 errors (under 5 %),
    # and the failure's latency is not an answer's latency.
    ledger(release, canary.STABLE, window(release, 0), requests=40)
    ledger(release, canary.CANARY, window(release, 0), requests=41, errors=1, latency_ms=[100_000.0] + [1000.0] * 40)
    [healthy] = canary.analyse_releases(now=end_of(release, 0))
    assert healthy["verdict"] == "healthy"
    release.refresh_from_db()
    assert release.last_analysis["arms"]["canary"]["p99_latency_ms"] == 1000.0

    # Too few stable requests to compare with: a slow canary is not judged on ratios.
    ledger(release, canary.STABLE, window(release, 1), requests=5)
    ledger(release, canary.CANARY, window(release, 1), requests=40, latency_ms=50_000.0, ttft_ms=9_000.0)
    [result] = canary.analyse_releases(now=end_of(release, 1))
    assert result["verdict"] == "healthy"
    assert result["reasons"] == ["p99 latency and TTFT not compared: stable had 5 requests < 20"]
    release.refresh_from_db()
    assert release.state == State.RUNNING


def test_only_generation_rows_of_this_release_inside_the_window_count(routes):
    release = start(routes, failing_windows_to_rollback=1)
    start_at = window(release, 0)
    ledger(release, canary.CANARY, start_at, requests=30)
    UsageRecord.objects.bulk_create(
        [
            # an embedding call, a row of no release, rows just outside the window: none counts
            UsageRecord(
                release=release, arm="canary", kind=UsageRecord.Kind.EMBEDDING, status="error", created_at=start_at
            ),
            UsageRecord(arm="canary", status="error", created_at=start_at),
            UsageRecord(release=release, arm="canary", status="error", created_at=end_of(release, 0)),
            UsageRecord(release=release, arm="canary", status="error", created_at=start_at - timedelta(seconds=1)),
        ]
    )
    [result] = canary.analyse_releases(now=end_of(release, 0))
    release.refresh_from_db()
    assert result["verdict"] == "healthy"
    assert release.last_analysis["arms"]["canary"]["requests"] == 30
    assert release.last_analysis["window"] == {
        "start": start_at.isoformat(),
        "end": end_of(release, 0).isoformat(),
        "seconds": WINDOW,
    }


def test_windows_missed_while_the_analysis_did_not_run_are_skipped_not_judged_late(routes):
    release = start(routes)
    ledger(release, canary.CANARY, window(release, 0), requests=40, errors=40)
    ledger(release, canary.CANARY, window(release, 3), requests=40)
    [result] = canary.analyse_releases(now=end_of(release, 3) + timedelta(seconds=10))
    release.refresh_from_db()
    assert result["verdict"] == "healthy"
    assert release.last_analysis["windows_skipped"] == 3
    assert release.last_analysis_at == end_of(release, 3)


def test_auto_promote_steps_on_each_healthy_window_then_promotes(routes):
    stable, candidate = routes
    release = start(routes, percent=Decimal("80"), auto_promote=True)
    for k in (0, 1):
        ledger(release, canary.STABLE, window(release, k), requests=30)
        ledger(release, canary.CANARY, window(release, k), requests=30)
    [first] = canary.analyse_releases(now=end_of(release, 0))
    assert first["action"] == "stepped"
    release.refresh_from_db()
    assert (release.state, release.percent) == (State.RUNNING, Decimal("90.00"))
    [second] = canary.analyse_releases(now=end_of(release, 1))
    assert second["action"] == "promoted"
    release.refresh_from_db()
    assert (release.state, release.percent) == (State.PROMOTED, Decimal("100.00"))
    assert actions(release) == [Action.STARTED, Action.STEPPED, Action.PROMOTED]
    stable.refresh_from_db()
    assert stable.provider_id == candidate.provider_id


def test_a_paused_release_is_never_promoted_but_is_still_rolled_back(routes):
    release = start(routes, auto_promote=True, failing_windows_to_rollback=1)
    canary.canary_release_pause(release)
    ledger(release, canary.CANARY, window(release, 0), requests=30)
    ledger(release, canary.CANARY, window(release, 1), requests=30, errors=30)
    assert canary.analyse_releases(now=end_of(release, 0))[0]["action"] == ""
    release.refresh_from_db()
    assert (release.state, release.percent) == (State.PAUSED, Decimal("25.00"))
    assert canary.analyse_releases(now=end_of(release, 1))[0]["action"] == "rolled_back"
    release.refresh_from_db()
    assert release.state == State.ROLLED_BACK


def test_the_periodic_task_runs_on_default_every_minute(routes):
    from inference.tasks import canary_analyse
    from ragsite.beat import BEAT_SCHEDULE
    from ragsite.celery import app

    route = app.amqp.router.route({}, "inference.tasks.canary_analyse", args=(), kwargs={})
    assert route["queue"].name == "default"
    # Listed before the inference.tasks.* pattern; generate_routed falls to that pattern (gpu)
    # unless its sender names the queue (router.submit always does).
    assert app.amqp.router.route({}, "inference.tasks.generate_routed", args=(), kwargs={})["queue"].name == "gpu"
    assert BEAT_SCHEDULE["canary-analyse"]["task"] == "inference.tasks.canary_analyse"
    assert BEAT_SCHEDULE["canary-analyse"]["schedule"] == 60.0

    release = start(routes)
    CanaryRelease.objects.filter(pk=release.pk).update(created_at=release.created_at - timedelta(seconds=WINDOW + 1))
    assert canary_analyse.apply().get() == [
        {
            "release": release.pk,
            "verdict": "inconclusive",
            "action": "",
            "reasons": ["canary had 0 requests < 20 needed to judge"],
        }
    ]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_default_queue_worker_runs_the_analysis_and_rolls_back(routes, start_worker):
    from inference.tasks import canary_analyse

    release = start(routes, failing_windows_to_rollback=1)
    began = release.created_at - timedelta(seconds=WINDOW + 30)
    CanaryRelease.objects.filter(pk=release.pk).update(created_at=began)
    ledger(release, canary.CANARY, began, requests=25, errors=25)
    with start_worker(["default"]):
        canary_analyse.delay()  # routed to "default" by TASK_ROUTES, as beat sends it
        deadline = time.monotonic() + 60
        while CanaryRelease.objects.get(pk=release.pk).state == State.RUNNING and time.monotonic() < deadline:
            time.sleep(0.2)
    release.refresh_from_db()
    assert release.state == State.ROLLED_BACK
    assert release.ended_reason == "canary error rate 1 > 0.05 over 300 s (25 requests) in 1 window"
