"""The upstream key pool: which key a request uses, and what each attempt did to the key.

The ``UpstreamKey`` rows are the pool, shared by every process through PostgreSQL; each
function is one SQL statement. ``upstream_key_pick``: the least recently used usable key,
marked used; ``route_with_key``: a route with its provider and its first key, in one
statement; ``upstream_key_succeeded`` and ``upstream_key_failed``: what an attempt did to its
key, by the attempt's error kind; ``has_usable`` and ``availability``: whether (and when) a
provider or a route's chain has a usable key. Rotation, cooldowns and the table of what each
kind does: docs/routing.md, "The key pool".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import connection

from inference.models import Provider, Route
from inference.secrets import decrypt
from ragsite.rows import Rows, cursor, fetch_one


@dataclass(frozen=True)
class PickedKey:
    id: int
    provider_id: int
    label: str
    last_four: str
    secret_encrypted: str = field(repr=False)

    def secret(self) -> str:
        return plaintext(self.id, self.secret_encrypted)

    def __str__(self) -> str:
        return f"{self.label} (…{self.last_four})"


@dataclass(frozen=True)
class KeyState:
    """A key's state after ``upstream_key_failed``."""

    status: str
    cooldown_until: datetime | None
    consecutive_failures: int


@dataclass(frozen=True)
class Availability:
    usable: int  # keys usable now, over all the providers asked about
    keys: int  # all their keys, whatever their state
    retry_after_s: float | None  # until the first cooling key comes back; None when none is cooling
    providers: list[dict]  # per provider: id, name, local, usable, cooling, disabled, keys, retry_after_s
    local: bool = False  # one of them is the local pool, which needs no key


@functools.lru_cache(maxsize=1024)
def plaintext(key_id: int, secret_encrypted: str) -> str:
    return decrypt(secret_encrypted)


_PICK = """
UPDATE inference_upstreamkey AS k
SET last_used_at = clock_timestamp(), status = 'active', cooldown_until = NULL
WHERE k.id = COALESCE(
    (SELECT id FROM inference_upstreamkey
     WHERE provider_id = {provider} AND NOT (id = ANY(%(exclude)s))
       AND (status = 'active' OR (status = 'cooling_down' AND cooldown_until <= clock_timestamp()))
     ORDER BY last_used_at ASC NULLS FIRST, id LIMIT 1 FOR UPDATE SKIP LOCKED),
    (SELECT id FROM inference_upstreamkey
     WHERE provider_id = {provider} AND NOT (id = ANY(%(exclude)s))
       AND (status = 'active' OR (status = 'cooling_down' AND cooldown_until <= clock_timestamp()))
     ORDER BY last_used_at ASC NULLS FIRST, id LIMIT 1)
)
AND (k.status = 'active' OR (k.status = 'cooling_down' AND k.cooldown_until <= clock_timestamp()))
{no_flush}
RETURNING k.id, k.provider_id, k.label, k.last_four, k.secret_encrypted
"""
_SUCCESS = "UPDATE inference_upstreamkey SET consecutive_failures = 0, success_count = success_count + 1 WHERE id = %s"
# Rotation and success counts are bookkeeping: their commits need not wait for the WAL
# flush (a database crash could lose the last fraction of a second of them, nothing
# else), which saves about a quarter of a millisecond per statement on the request path.
# ``set_config(..., true)`` lasts for the statement's own transaction: outside a
# transaction only. Failures (cooldowns, disabled keys) always wait for the flush.
_NO_FLUSH = "AND set_config('synchronous_commit', 'off', true) IS NOT NULL"


def _pick_sql(provider: str) -> str:
    """The pick statement for the provider that SQL expression ``provider`` names."""
    return _PICK.format(provider=provider, no_flush="" if connection.in_atomic_block else _NO_FLUSH)


def upstream_key_pick(provider_id: int, *, exclude: tuple[int, ...] | list[int] | set[int] = ()) -> PickedKey | None:
    """The least recently used usable key of the provider (not in ``exclude``), marked used.

    The second subquery runs only when the first finds nothing (COALESCE evaluates lazily):
    one statement either way. The outer condition re-checks usability after a lock wait.
    """
    with cursor() as cursor_:
        cursor_.execute(_pick_sql("%(provider)s"), {"provider": provider_id, "exclude": sorted(exclude)})
        row = cursor_.fetchone()
    return PickedKey(*row) if row else None


def upstream_key_succeeded(key_id: int) -> None:
    """(A routed request does this in the statement that writes its ledger row.)"""
    with cursor() as cursor_:
        cursor_.execute(_SUCCESS + " " + (_NO_FLUSH if not connection.in_atomic_block else ""), [key_id])


@functools.cache
def route_rows() -> Rows:
    """A route and its provider, aliased ``r`` and ``p``: what every routed request reads first."""
    return Rows((Route, "r"), (Provider, "p"))


def route_with_key(route_id: int) -> tuple:
    """The route with its provider and, for a remote provider, its next key as ``upstream_key_pick``
    chooses it (or None): one statement, the first of every routed request."""
    rows = route_rows()
    provider = (
        "(SELECT route.provider_id FROM inference_route route JOIN inference_provider provider "
        "ON provider.id = route.provider_id WHERE route.id = %(route)s AND provider.kind <> 'local')"
    )
    # Column names from the models, constant SQL: the values are all bound parameters.
    sql = f"WITH picked AS ({_pick_sql(provider)}) SELECT {rows.columns}, picked.* FROM inference_route r "  # noqa: S608
    sql += "JOIN inference_provider p ON p.id = r.provider_id LEFT JOIN picked ON true WHERE r.id = %(route)s"
    row = fetch_one(sql, {"route": route_id, "exclude": []})
    if row is None:
        raise rows.parts[0][0].DoesNotExist(f"route {route_id} does not exist")
    route, provider_row = rows.instances(row)
    route.provider = provider_row
    key = row[rows.width :]
    return route, (PickedKey(*key) if key[0] is not None else None)


_HAS_USABLE = """
SELECT EXISTS (SELECT 1 FROM inference_upstreamkey WHERE provider_id = %s
    AND (status = 'active' OR (status = 'cooling_down' AND cooldown_until <= clock_timestamp())))
"""


def has_usable(provider_id: int) -> bool:
    """Whether the provider has a key usable now (the cheap check before ``availability``)."""
    with cursor() as cursor_:
        cursor_.execute(_HAS_USABLE, [provider_id])
        return cursor_.fetchone()[0]


# What every counted failure does to its key, after the statement's own changes.
_COUNTED = """
    consecutive_failures = consecutive_failures + 1,
    failure_count = failure_count + 1,
    last_error = %(message)s,
    last_failure_at = clock_timestamp()
WHERE id = %(id)s
RETURNING status, cooldown_until, consecutive_failures
"""

# The exponent of the cooldown without a header stops growing at 20 (2^20 s is 12 days).
_RATE_LIMITED = (
    """
UPDATE inference_upstreamkey SET
    status = CASE WHEN status = 'disabled' THEN status ELSE 'cooling_down' END,
    cooldown_until = CASE WHEN status = 'disabled' THEN cooldown_until ELSE GREATEST(
        clock_timestamp() + make_interval(secs => COALESCE(
            %(retry_after)s::float8,
            LEAST(%(base)s::float8 * power(2, LEAST(consecutive_failures, 20)), %(cap)s::float8)
        )),
        CASE WHEN status = 'cooling_down' THEN cooldown_until END
    ) END,
"""
    + _COUNTED
)

_DISABLE = (
    """
UPDATE inference_upstreamkey SET
    status = 'disabled', cooldown_until = NULL, disabled_reason = %(reason)s,
"""
    + _COUNTED
)

_FAILED = (
    """
UPDATE inference_upstreamkey SET
"""
    + _COUNTED
)


def disabled_reason(provider_name: str, status: int | None, message: str) -> str:
    what = f"HTTP {status}" if status else "refused"
    return (
        f"Disabled automatically: provider {provider_name} answered {what} for this key ({message}). "
        "Check the key with the provider, replace it or fix its account, then re-enable it here (the "
        "'Re-enable' action of Upstream keys); until then it is never used."
    )


def upstream_key_failed(
    key_id: int, *, kind: str, message: str, provider_name: str, status: int | None = None, retry_after_s=None
) -> KeyState | None:
    """Record a failed attempt with this key (see the module docstring); the key's new state."""
    if kind == "bad_request":
        return None
    params = {"id": key_id, "message": message[:2000]}
    if kind == "rate_limited":
        sql = _RATE_LIMITED
        params.update(
            retry_after=retry_after_s,
            base=settings.UPSTREAM_KEY_COOLDOWN_BASE_S,
            cap=settings.UPSTREAM_KEY_COOLDOWN_MAX_S,
        )
    elif kind in ("unauthorized", "unreadable"):
        sql = _DISABLE
        params["reason"] = (
            disabled_reason(provider_name, status, message)
            if kind == "unauthorized"
            else f"Disabled automatically: {message}. Enter the key again here, or configure the encryption key "
            "it was stored with in UPSTREAM_KEY_ENCRYPTION_KEYS, then re-enable it (the 'Re-enable' action)."
        )
    else:
        sql = _FAILED
    with cursor() as cursor_:
        cursor_.execute(sql, params)
        row = cursor_.fetchone()
    return KeyState(*row) if row else None


_AVAILABILITY = """
SELECT p.id, p.name, p.kind,
    count(k.id) FILTER (
        WHERE k.status = 'active' OR (k.status = 'cooling_down' AND k.cooldown_until <= clock_timestamp())
    ),
    count(k.id) FILTER (WHERE k.status = 'cooling_down' AND k.cooldown_until > clock_timestamp()),
    count(k.id) FILTER (WHERE k.status = 'disabled'),
    count(k.id),
    EXTRACT(EPOCH FROM min(k.cooldown_until - clock_timestamp())
        FILTER (WHERE k.status = 'cooling_down' AND k.cooldown_until > clock_timestamp()))::float8
FROM inference_provider p
LEFT JOIN inference_upstreamkey k ON k.provider_id = p.id
WHERE p.id IN ({providers})
GROUP BY p.id, p.name, p.kind
ORDER BY p.id
"""
# A route's provider and those of its enabled fallbacks on enabled providers.
_ROUTE_PROVIDERS = """
SELECT provider_id FROM inference_route WHERE id = %s
UNION
SELECT fallback.provider_id FROM inference_routefallback link
JOIN inference_route fallback ON fallback.id = link.fallback_id
JOIN inference_provider provider ON provider.id = fallback.provider_id
WHERE link.route_id = %s AND fallback.enabled AND provider.enabled
"""


def availability(provider_ids: list[int] | None = None, *, route_id: int | None = None) -> Availability:
    """Usable keys now over these providers (or over a route's and its fallbacks'), and when
    the first cooling key comes back; one query. A local provider needs no key: ``local``."""
    if route_id is not None:
        sql, params = _AVAILABILITY.format(providers=_ROUTE_PROVIDERS), [route_id, route_id]
    else:
        sql, params = _AVAILABILITY.format(providers="SELECT unnest(%s::bigint[])"), [list(provider_ids or ())]
    with cursor() as cursor_:
        cursor_.execute(sql, params)
        rows = cursor_.fetchall()
    providers = [
        {
            "id": row[0],
            "name": row[1],
            "local": row[2] == "local",
            "usable": row[3],
            "cooling": row[4],
            "disabled": row[5],
            "keys": row[6],
            "retry_after_s": row[7],
        }
        for row in rows
    ]
    waits = [p["retry_after_s"] for p in providers if p["retry_after_s"] is not None]
    return Availability(
        usable=sum(p["usable"] for p in providers),
        keys=sum(p["keys"] for p in providers),
        retry_after_s=min(waits) if waits else None,
        providers=providers,
        local=any(p["local"] for p in providers),
    )


def unavailable_message(route_name: str, availability: Availability) -> str:
    """Why no key can serve, per provider, and what to do."""
    parts = []
    for provider in availability.providers:
        if provider["local"]:
            continue
        name = provider["name"]
        if provider["keys"] == 0:
            parts.append(f"provider {name} has no upstream key: add one in the admin (Inference, Upstream keys)")
            continue
        states = []
        if provider["cooling"]:
            states.append(
                f"{provider['cooling']} cooling down after rate limits (the first is back in "
                f"{provider['retry_after_s']:.1f} s)"
            )
        if provider["disabled"]:
            states.append(
                f"{provider['disabled']} disabled after the provider rejected them (see each key's reason "
                "in the admin; replace or re-enable them)"
            )
        parts.append(f"provider {name}: {' and '.join(states) or 'no usable key'}")
    return f"route {route_name!r} cannot be served now: " + "; ".join(parts)
