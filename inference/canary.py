"""Canary releases: which arm a client gets (sticky), operator actions, and the analysis that rolls back.

Arms. A client's arm comes from HMAC-SHA256(key, "<release id>:<client id>") read as a
number into 10,000 buckets: the same client gets the same arm in every process and after
every restart (never Python's ``hash()``, which is salted per process), and raising the
percent only moves clients from stable to canary, never back.

Operator actions (``canary_release_start``, ``_percent_set``, ``_step``, ``_pause``, ``_resume``,
``_promote``, ``_roll_back``) lock the release row (``SELECT ... FOR UPDATE``), change it and
record a ``CanaryEvent`` in the same transaction, so an operator's edit and the periodic analysis
never overwrite each other's changes. They raise ``CanaryActionRefused`` for a change that
makes no sense in the release's state (stepping a rolled-back release...).

Promotion (``canary_release_promote``, or a step that reaches 100 %) does what Flagger and Argo Rollouts
do: the new version becomes the stable one. The stable route (the name callers use) takes
the canary route's target (provider, max_tokens, temperature, top_p, system prompt), the
release ends as ``promoted`` and every client is served by the stable route again, now
running the new version. The stable route's previous target is kept in the event's metrics.

Analysis (``analyse_releases``, run by beat every minute through
``inference.tasks.canary_analyse``): tumbling windows of ``window_seconds`` aligned on the
release's creation; each window is judged once, after it has ended (``last_analysis_at`` is
the end of the last window analysed). See docs/routing.md, "Canary releases".
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, Q
from django.utils import timezone

from billing.models import UsageRecord
from inference.models import CanaryEvent, CanaryRelease, Route
from ragsite.aggregates import PercentileCont
from ragsite.errors import DomainError

logger = logging.getLogger(__name__)

STABLE = "stable"
CANARY = "canary"
BUCKETS = 10_000
HUNDRED = Decimal("100")
CENT = Decimal("0.01")

# What promotion copies from the canary route onto the stable route.
PROMOTED_ROUTE_FIELDS = ("provider", "max_tokens", "temperature", "top_p", "system_prompt")


def bucket(release_id: int, client_id: str) -> int:
    digest = hmac.new(settings.CANARY_HASH_KEY.encode(), f"{release_id}:{client_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def arm_of(release: CanaryRelease, client_id: str) -> str:
    # percent has two decimals: 12.34 % is 1,234 of the 10,000 buckets.
    threshold = int(Decimal(release.percent) * BUCKETS / 100)
    return CANARY if bucket(release.id, client_id) < threshold else STABLE


def live_release(route: Route) -> CanaryRelease | None:
    return (
        CanaryRelease.objects.select_related("canary_route__provider")
        .filter(stable_route=route, state__in=CanaryRelease.LIVE_STATES)
        .first()
    )


def arm_for(route: Route, client_id: str) -> tuple[CanaryRelease | None, str]:
    """The live release on ``route`` and this client's arm, or ``(None, "")`` without one.

    A paused release keeps its percent: paused stops promotion, not traffic.
    """
    release = live_release(route)
    if release is None:
        return None, ""
    if not release.canary_route.enabled or not release.canary_route.provider.enabled:
        return release, STABLE
    return release, arm_of(release, client_id)


# -- operator actions -------------------------------------------------------------------


class CanaryActionRefused(DomainError, ValueError):
    """An action that does not apply to the release in its current state."""


State = CanaryRelease.State
Action = CanaryEvent.Action


def _percent(value) -> Decimal:
    try:
        percent = Decimal(str(value)).quantize(CENT)
    except (InvalidOperation, ValueError):
        raise CanaryActionRefused(f"percent must be a number from 0 to 100, got {value!r}") from None
    if not 0 <= percent <= HUNDRED:
        raise CanaryActionRefused(f"percent must be from 0 to 100, got {value}")
    return percent


def _lock(release: CanaryRelease | int) -> CanaryRelease:
    """The release's row, locked until the transaction ends (call inside ``transaction.atomic``)."""
    pk = release.pk if isinstance(release, CanaryRelease) else release
    return CanaryRelease.objects.select_for_update().select_related("stable_route", "canary_route").get(pk=pk)


def _event(
    release: CanaryRelease, action: str, *, percent_from=None, percent_to=None, reason="", actor=None, metrics=None
):
    return CanaryEvent.objects.create(
        release=release,
        action=action,
        percent_from=percent_from,
        percent_to=percent_to,
        reason=reason,
        actor=actor if actor is not None and getattr(actor, "pk", None) else None,
        metrics=metrics or {},
    )


def _require_live(release: CanaryRelease, action: str) -> None:
    if not release.is_live:
        raise CanaryActionRefused(
            f"cannot {action} release {release.name!r}: it is {release.get_state_display().lower()}"
        )


def _who(actor) -> str:
    return f"by {actor}" if actor is not None and getattr(actor, "pk", None) else "automatically"


def canary_release_start(
    release: CanaryRelease | None = None, *, actor=None, reason: str = "", **fields
) -> CanaryRelease:
    """Create a release (from an unsaved instance, as the admin's add form has, or from
    ``fields``) in state running at its percent, and record STARTED."""
    if release is None:
        release = CanaryRelease(**fields)
    elif fields:
        raise TypeError("pass either an unsaved release or its fields, not both")
    if release.pk is not None:
        raise CanaryActionRefused("this release has already been started")
    release.state = State.RUNNING
    release.percent = _percent(release.percent)
    release.consecutive_failing_windows = 0
    release.full_clean(validate_constraints=False)
    if release.stable_route_id and (other := _live_on(release.stable_route_id)):
        raise CanaryActionRefused(
            f"route {release.stable_route} already has a live release ({other.name}); promote or roll it back first"
        )
    try:
        with transaction.atomic():
            release.save()
            _event(release, Action.STARTED, percent_to=release.percent, reason=reason, actor=actor)
    except IntegrityError:
        if other := _live_on(release.stable_route_id):  # started concurrently
            raise CanaryActionRefused(
                f"route {release.stable_route} already has a live release ({other.name}); promote or roll it back first"
            ) from None
        raise
    return release


def _live_on(route_id: int) -> CanaryRelease | None:
    return CanaryRelease.objects.filter(stable_route_id=route_id, state__in=CanaryRelease.LIVE_STATES).first()


def _set_percent(release: CanaryRelease, percent: Decimal, *, action: str, actor, reason: str, metrics=None) -> None:
    before = release.percent
    release.percent = percent
    release.save()
    _event(release, action, percent_from=before, percent_to=percent, reason=reason, actor=actor, metrics=metrics)


def canary_release_percent_set(release: CanaryRelease | int, percent, *, actor=None, reason: str = "") -> CanaryRelease:
    """Send ``percent`` % of the stable route's clients to the canary. 100 keeps the release
    running with every client on the canary (analysis goes on); ``canary_release_promote`` ends it."""
    percent = _percent(percent)
    with transaction.atomic():
        release = _lock(release)
        _require_live(release, "change the percent of")
        _set_percent(release, percent, action=Action.PERCENT_SET, actor=actor, reason=reason)
    return release


def _step(release: CanaryRelease, *, actor, reason: str, metrics=None) -> None:
    target = min(release.percent + release.step_percent, HUNDRED)
    if target >= HUNDRED:
        _promote(release, actor=actor, reason=reason or f"stepped to 100% {_who(actor)}", metrics=metrics)
    else:
        _set_percent(release, target, action=Action.STEPPED, actor=actor, reason=reason, metrics=metrics)


def canary_release_step(release: CanaryRelease | int, *, actor=None, reason: str = "") -> CanaryRelease:
    """Add ``step_percent`` (capped at 100); reaching 100 promotes the release."""
    with transaction.atomic():
        release = _lock(release)
        _require_live(release, "step")
        _step(release, actor=actor, reason=reason)
    return release


def canary_release_pause(release: CanaryRelease | int, *, actor=None, reason: str = "") -> CanaryRelease:
    """Stop automatic promotion. Traffic keeps its percent, and the analysis still rolls
    back a failing canary: clients on the canary arm are still served by it."""
    return _change_state(release, "pause", State.RUNNING, State.PAUSED, Action.PAUSED, actor=actor, reason=reason)


def canary_release_resume(release: CanaryRelease | int, *, actor=None, reason: str = "") -> CanaryRelease:
    return _change_state(release, "resume", State.PAUSED, State.RUNNING, Action.RESUMED, actor=actor, reason=reason)


def _change_state(release, verb: str, from_state: str, to_state: str, action: str, *, actor, reason) -> CanaryRelease:
    """Move a release between running and paused under its row lock, recording the event."""
    with transaction.atomic():
        release = _lock(release)
        if release.state != from_state:
            raise CanaryActionRefused(
                f"cannot {verb} release {release.name!r}: it is {release.get_state_display().lower()}"
            )
        release.state = to_state
        release.save()
        _event(release, action, percent_from=release.percent, percent_to=release.percent, reason=reason, actor=actor)
    return release


def _route_target(route: Route) -> dict:
    return {
        "provider_id": route.provider_id,
        "provider": str(route.provider),
        **{name: getattr(route, name) for name in PROMOTED_ROUTE_FIELDS if name != "provider"},
    }


def _promote(release: CanaryRelease, *, actor, reason: str, metrics=None) -> None:
    stable = Route.objects.select_for_update().select_related("provider").get(pk=release.stable_route_id)
    canary = Route.objects.select_related("provider").get(pk=release.canary_route_id)
    before = _route_target(stable)
    for name in PROMOTED_ROUTE_FIELDS:
        setattr(stable, name, getattr(canary, name))
    stable.save()
    percent_before = release.percent
    release.percent = HUNDRED
    release.state = State.PROMOTED
    release.ended_reason = reason or f"promoted {_who(actor)}"
    release.ended_reason += (
        f"; route {stable.name} now serves {canary.name}'s target ({canary.provider}, {canary.provider.model})"
    )
    release.save()
    _event(
        release,
        Action.PROMOTED,
        percent_from=percent_before,
        percent_to=HUNDRED,
        reason=release.ended_reason,
        actor=actor,
        metrics={**(metrics or {}), "stable_route_before": before, "stable_route_after": _route_target(stable)},
    )


def canary_release_promote(release: CanaryRelease | int, *, actor=None, reason: str = "") -> CanaryRelease:
    """End the release: the stable route takes the canary route's target and serves everyone."""
    with transaction.atomic():
        release = _lock(release)
        _require_live(release, "promote")
        _promote(release, actor=actor, reason=reason)
    return release


def _roll_back(release: CanaryRelease, reason: str, *, actor, metrics=None) -> None:
    percent_before = release.percent
    release.percent = Decimal("0")
    release.state = State.ROLLED_BACK
    release.ended_reason = reason
    release.save()
    _event(
        release,
        Action.ROLLED_BACK,
        percent_from=percent_before,
        percent_to=release.percent,
        reason=reason,
        actor=actor,
        metrics=metrics,
    )


def canary_release_roll_back(release: CanaryRelease | int, reason: str = "", *, actor=None) -> CanaryRelease:
    """Send every client back to the stable route and end the release (percent 0)."""
    with transaction.atomic():
        release = _lock(release)
        _require_live(release, "roll back")
        _roll_back(release, reason.strip() or f"rolled back {_who(actor)}", actor=actor)
    return release


# -- analysis ---------------------------------------------------------------------------


@dataclass
class ArmStats:
    requests: int = 0
    errors: int = 0
    error_rate: float | None = None
    p99_latency_ms: float | None = None
    p99_ttft_ms: float | None = None


def window_stats(release_id: int, start: datetime, end: datetime) -> dict[str, ArmStats]:
    """Each arm's generations in ``[start, end)`` from the ledger, in one query.

    Error rate: status ``error`` over all rows (cancelled ones included). p99 latency: over
    answered (``ok``) rows, since a failure's latency says when it failed, and failures are
    judged by the error rate. p99 TTFT: over every row that got a first token.
    """
    ok = Q(status=UsageRecord.Status.OK)
    rows = (
        UsageRecord.objects.filter(
            release_id=release_id,
            kind=UsageRecord.Kind.GENERATION,
            arm__in=(STABLE, CANARY),
            created_at__gte=start,
            created_at__lt=end,
        )
        .order_by()
        .values("arm")
        .annotate(
            requests=Count("id"),
            errors=Count("id", filter=Q(status=UsageRecord.Status.ERROR)),
            p99_latency_ms=PercentileCont("latency_ms", 0.99, filter=ok),
            p99_ttft_ms=PercentileCont("ttft_ms", 0.99),
        )
    )
    stats = {STABLE: ArmStats(), CANARY: ArmStats()}
    for row in rows:
        stats[row["arm"]] = ArmStats(
            requests=row["requests"],
            errors=row["errors"],
            error_rate=row["errors"] / row["requests"] if row["requests"] else None,
            p99_latency_ms=row["p99_latency_ms"],
            p99_ttft_ms=row["p99_ttft_ms"],
        )
    return stats


def _num(value: float | Decimal) -> str:
    return f"{float(value):.3g}"


def _ms(value: float) -> str:
    return f"{value:.0f} ms" if value >= 10 else f"{value:.3g} ms"


def judge(release: CanaryRelease, stats: dict[str, ArmStats]) -> tuple[str, list[str], list[str]]:
    """``(verdict, failures, notes)``: verdict ``failing``, ``healthy`` or ``inconclusive``.

    Judged only with at least ``min_requests`` canary requests. The latency and TTFT ratios
    need a baseline: with fewer than ``min_requests`` stable requests (or no stable values)
    they are not compared, and only the error rate (an absolute threshold) judges the window.
    """
    canary, stable = stats[CANARY], stats[STABLE]
    seconds = release.window_seconds
    needed = max(release.min_requests, 1)
    if canary.requests < needed:
        return "inconclusive", [], [f"canary had {canary.requests} requests < {needed} needed to judge"]
    over = f"over {seconds} s ({canary.requests} requests)"
    failures: list[str] = []
    notes: list[str] = []
    if canary.error_rate > release.max_error_rate:
        failures.append(f"canary error rate {_num(canary.error_rate)} > {_num(release.max_error_rate)} {over}")
    if stable.requests < release.min_requests:
        notes.append(
            f"p99 latency and TTFT not compared: stable had {stable.requests} requests < {release.min_requests}"
        )
    else:
        for label, field, ratio in (
            ("p99 latency", "p99_latency_ms", release.max_p99_latency_ratio),
            ("p99 TTFT", "p99_ttft_ms", release.max_ttft_ratio),
        ):
            mine, theirs = getattr(canary, field), getattr(stable, field)
            if mine is None or theirs is None:
                notes.append(f"{label} not compared: {'canary' if mine is None else 'stable'} has no values")
            elif mine > float(ratio) * theirs:
                failures.append(
                    f"canary {label} {_ms(mine)} > {_num(ratio)} x stable {_ms(theirs)} "
                    f"(ratio {mine / theirs if theirs else float('inf'):.2f}) {over}"
                )
    return ("failing" if failures else "healthy"), failures, notes


def _thresholds(release: CanaryRelease) -> dict:
    return {
        "max_error_rate": float(release.max_error_rate),
        "max_p99_latency_ratio": float(release.max_p99_latency_ratio),
        "max_ttft_ratio": float(release.max_ttft_ratio),
        "min_requests": release.min_requests,
        "window_seconds": release.window_seconds,
        "failing_windows_to_rollback": release.failing_windows_to_rollback,
    }


def analyse_release(release: CanaryRelease | int, now: datetime | None = None) -> dict | None:
    """Judge the release's newest complete window if it has not been judged; ``None`` when
    no window has ended since the last one (or the release has ended).

    Windows tumble: ``[anchor + kW, anchor + (k+1)W)`` from the release's creation, each
    analysed once. Windows that ended while the analysis did not run (beat down) are skipped,
    not judged late; the count of consecutive failing windows is left as it was.
    """
    now = now or timezone.now()
    with transaction.atomic():
        release = _lock(release)
        if not release.is_live:
            return None
        width = timedelta(seconds=release.window_seconds)
        anchor = release.last_analysis_at or release.created_at
        complete = (now - anchor) // width
        if complete < 1:
            return None
        end = anchor + complete * width
        start = end - width
        stats = window_stats(release.pk, start, end)
        verdict, failures, notes = judge(release, stats)
        if verdict == "failing":
            release.consecutive_failing_windows += 1
        elif verdict == "healthy":
            release.consecutive_failing_windows = 0
        analysis = {
            "window": {"start": start.isoformat(), "end": end.isoformat(), "seconds": release.window_seconds},
            "windows_skipped": complete - 1,
            "analysed_at": now.isoformat(),
            "percent": str(release.percent),
            "arms": {arm: asdict(arm_stats) for arm, arm_stats in stats.items()},
            "verdict": verdict,
            "reasons": failures + notes,
            "thresholds": _thresholds(release),
            "consecutive_failing_windows": release.consecutive_failing_windows,
            "action": "",
        }
        release.last_analysis_at = end
        release.last_analysis = analysis
        release.save()
        if verdict == "failing":
            _event(
                release,
                Action.WINDOW_FAILED,
                percent_from=release.percent,
                percent_to=release.percent,
                reason="; ".join(failures),
                metrics=analysis,
            )
            count = release.consecutive_failing_windows
            if count >= release.failing_windows_to_rollback:
                windows = f"in {count} consecutive windows" if count > 1 else "in 1 window"
                analysis["action"] = "rolled_back"
                _roll_back(release, f"{'; '.join(failures)} {windows}", actor=None, metrics=analysis)
        elif verdict == "healthy" and release.auto_promote and release.state == State.RUNNING:
            promotes = release.percent + release.step_percent >= HUNDRED
            analysis["action"] = "promoted" if promotes else "stepped"
            _step(release, actor=None, reason="healthy window: automatic promotion step", metrics=analysis)
        if analysis["action"]:
            release.last_analysis = analysis
            release.save(update_fields=["last_analysis", "updated_at"])
    return {"release": release.pk, "verdict": verdict, "action": analysis["action"], "reasons": analysis["reasons"]}


def analyse_releases(now: datetime | None = None) -> list[dict]:
    """Analyse every live release (running or paused: a paused release still serves canary
    clients, so it is still rolled back when failing; it is never promoted automatically)."""
    now = now or timezone.now()
    results = []
    for release_id in CanaryRelease.objects.filter(state__in=CanaryRelease.LIVE_STATES).values_list("pk", flat=True):
        try:
            result = analyse_release(release_id, now)
        except Exception:  # one broken release must not stop the analysis of the others
            logger.exception("canary analysis of release %s failed", release_id)
            continue
        if result is not None:
            results.append(result)
    return results
