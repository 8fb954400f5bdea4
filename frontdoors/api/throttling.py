"""Requests per minute per client on the endpoints that generate nothing.

Creating an answer is metered per key by ``billing.limits`` (requests and tokens per
minute, the monthly budget: ``answer_create`` admits each generation). Everything else
(listing, uploading, searching, reading answers and usage) costs database and embedding
time but no money, and is throttled here: DRF's sliding-window throttle, its history in the
default cache (Redis, so it holds across web processes), one bucket per API key, else per
user, at ``REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["api"]``. DRF's throttle reads and writes
the history without a lock: concurrent requests of one client may pass a few over the rate.
That is acceptable for a guard against runaway clients, which is all this is; money is
guarded by billing.limits' atomic scripts.
"""

from __future__ import annotations

from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle

from billing.models import ClientKey


class ApiRateThrottle(SimpleRateThrottle):
    scope = "api"

    def get_rate(self) -> str | None:
        # Read per request, not once at import as DRF does, so the setting can change in tests.
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)

    def get_cache_key(self, request, view) -> str:
        # Throttles run after the permission check: the caller is a key or a member.
        ident = f"key:{request.auth.pk}" if isinstance(request.auth, ClientKey) else f"user:{request.user.pk}"
        return f"throttle_{self.scope}_{ident}"
