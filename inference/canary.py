"""Canary releases: which arm a client gets (sticky), and the analysis that rolls back.

A client's arm comes from HMAC-SHA256(key, "<release id>:<client id>") read as a number
into 10,000 buckets: the same client gets the same arm in every process and after every
restart (never Python's ``hash()``, which is salted per process), and raising the percent
only moves clients from stable to canary, never back.
"""

from __future__ import annotations

import hashlib
import hmac
from decimal import Decimal

from django.conf import settings

from inference.models import CanaryRelease, Route

STABLE = "stable"
CANARY = "canary"
BUCKETS = 10_000


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
