"""Limits per client key: requests and tokens per minute, and a monthly budget in USD.

Enforced in Redis by one Lua script per decision (billing/lua/), atomic, one round trip. A
request is admitted (``admission_reserve``) before its generation and settled
(``admission_settle``) after it, or released (``admission_release``) when it never ran.
``ClientKey`` holds the limits; None is unlimited. Money is integers of 1e-12 USD, never a
double. The design (a sliding-window log, reservations, recovery from the ledger, alerts):
docs/billing.md, "How limits and budgets are kept".
"""

from __future__ import annotations

import functools
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import redis
from django.conf import settings
from django.db.models import Sum
from django.utils import timezone
from redis.commands.core import Script

from billing.models import BudgetAlert, ClientKey, UsageRecord
from billing.pricing import cost_of, price_at
from ragsite.errors import DomainError
from ragsite.redis import Role, redis_client

logger = logging.getLogger(__name__)

WINDOW_S = 60
# Window entries are pruned by the scripts; the keys' own expiry only clears idle keys.
WINDOW_KEY_TTL_MS = 2 * WINDOW_S * 1000
# A request may wait in its Celery queue before the router's deadline starts.
RESERVATION_MARGIN_S = 300
# The month's keys outlive the month by this much, for settlements of requests admitted at
# its end (a month read after it expired is initialised from the ledger again).
MONTH_KEY_GRACE = timedelta(days=7)
# A second settlement of the same reservation (a retried callback) comes seconds after the
# first; an hour is ample, and bounds the markers to an hour of requests (about 100 bytes each).
SETTLED_MARKER_TTL_S = 3600
# The budget is held by the key's own requests in flight: they usually settle within seconds.
HELD_RETRY_AFTER_S = 1.0
ALERT_THRESHOLDS = (80, 100)
PICO = 12  # decimal places of the amounts in Redis: 1e-12 USD


class LimitExceeded(DomainError):
    """A request refused by a key's limits. ``status``: the HTTP status the APIs answer
    (429 with ``Retry-After: retry_after_s`` when rate limited, 402 when the budget is
    spent); ``message`` names the limit and the numbers."""

    def __init__(self, code: str, status: int, message: str, retry_after_s: float | None = None):
        super().__init__(message, code=code, status=status, retry_after_s=retry_after_s)


class ModelUnpriced(LimitExceeded):
    """A key with a budget asked for a model that has no price: its cost cannot be reserved."""

    def __init__(self, message: str):
        super().__init__("model_unpriced", 402, message)


@dataclass(frozen=True)
class Admission:
    """An admitted request, to be settled or released once. ``reserved_usd``: the maximum
    cost reserved against the budget (None: the key has no budget). ``windowed``: it took an
    entry in the per-minute window (the key has a per-minute limit)."""

    reservation_id: str
    reserved_usd: Decimal | None
    estimated_tokens: int
    key_id: int
    month: date
    budget_usd: Decimal | None = None
    windowed: bool = False
    admitted_at: datetime | None = None
    key_label: str = ""

    def as_json(self) -> dict:
        """For a task's payload and the ledger row (exact: amounts as decimal strings)."""
        return {
            "reservation_id": self.reservation_id,
            "reserved_usd": None if self.reserved_usd is None else str(self.reserved_usd),
            "estimated_tokens": self.estimated_tokens,
            "key_id": self.key_id,
            "month": self.month.isoformat(),
            "budget_usd": None if self.budget_usd is None else str(self.budget_usd),
            "windowed": self.windowed,
            "admitted_at": None if self.admitted_at is None else self.admitted_at.isoformat(),
            "key_label": self.key_label,
        }

    @classmethod
    def from_json(cls, data: dict) -> Admission:
        return cls(
            reservation_id=data["reservation_id"],
            reserved_usd=None if data.get("reserved_usd") is None else Decimal(data["reserved_usd"]),
            estimated_tokens=int(data["estimated_tokens"]),
            key_id=int(data["key_id"]),
            month=date.fromisoformat(data["month"]),
            budget_usd=None if data.get("budget_usd") is None else Decimal(data["budget_usd"]),
            windowed=bool(data.get("windowed")),
            admitted_at=None if not data.get("admitted_at") else datetime.fromisoformat(data["admitted_at"]),
            key_label=data.get("key_label") or "",
        )


@dataclass(frozen=True)
class BudgetState:
    """A key's month as Redis counts it: settled costs, and the reservations still counting."""

    month: date
    spent_usd: Decimal
    reserved_usd: Decimal
    in_flight: int
    budget_usd: Decimal | None


def reservation_ttl_s() -> float:
    """How long an unsettled reservation counts: the router's deadline plus time queued."""
    return settings.ROUTER_DEADLINE_S + RESERVATION_MARGIN_S


# --------------------------------------------------------------------------- Lua

# The scripts live in billing/lua/, each with its KEYS, ARGV and replies; common.lua holds the
# helpers the others use (and the rule for amounts: canonical decimal strings, never doubles).
_LUA = Path(__file__).resolve().parent / "lua"


def _lua(*names: str) -> str:
    return "\n".join((_LUA / f"{name}.lua").read_text() for name in names)


_ADMIT = _lua("common", "admit")
_SETTLE = _lua("common", "settle")
_INITIALISE = _lua("initialise")
_VIEW = _lua("common", "view")


@dataclass(frozen=True)
class _Scripts:
    admit: Script
    settle: Script
    initialise: Script
    view: Script


@functools.cache
def _scripts(client: redis.Redis) -> _Scripts:
    """Registered once per client (``redis_client`` keeps one per process): EVALSHA after."""
    return _Scripts(
        admit=client.register_script(_ADMIT),
        settle=client.register_script(_SETTLE),
        initialise=client.register_script(_INITIALISE),
        view=client.register_script(_VIEW),
    )


# --------------------------------------------------------------------------- keys and units


def _prefix(key_id: int) -> str:
    # The braces are a hash tag: a key's keys share one Redis Cluster slot, as scripts need.
    return f"limits:{{{key_id}}}"


def _window_keys(key_id: int) -> list[str]:
    prefix = _prefix(key_id)
    return [f"{prefix}:window", f"{prefix}:window:tokens", f"{prefix}:window:token_sum"]


def _month_keys(key_id: int, month: date) -> list[str]:
    base = f"{_prefix(key_id)}:{month:%Y-%m}"
    return [base, f"{base}:held", f"{base}:amounts"]


def _settled_key(key_id: int, reservation_id: str) -> str:
    return f"{_prefix(key_id)}:settled:{reservation_id}"


def _to_pico(usd: Decimal) -> int:
    """USD as an integer of 1e-12 USD; a finer amount is refused rather than rounded."""
    scaled = usd.scaleb(PICO)
    if scaled != scaled.to_integral_value():
        raise ValueError(f"{usd} USD is finer than 1e-12 USD, the ledger's precision")
    return int(scaled)


def _from_pico(amount: int | bytes | str) -> Decimal:
    return Decimal(int(amount)).scaleb(-PICO)


def _usd(amount: Decimal) -> str:
    return f"{amount.normalize():f}"


def _now(now: datetime | None) -> datetime:
    now = now or timezone.now()
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    return now.astimezone(UTC)


def _micros(at: datetime) -> int:
    # Integer arithmetic on the timedelta: a float timestamp would lose the microseconds.
    return (at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def _month_of(at: datetime) -> date:
    return date(at.year, at.month, 1)


def _next_month(month: date) -> date:
    return date(month.year + month.month // 12, month.month % 12 + 1, 1)


def _month_bounds(month: date) -> tuple[datetime, datetime]:
    start = datetime(month.year, month.month, 1, tzinfo=UTC)
    end_day = _next_month(month)
    return start, datetime(end_day.year, end_day.month, 1, tzinfo=UTC)


def _month_ttl_s(month: date, now: datetime) -> int:
    # Relative to ``now`` rather than a date: the keys live as long after ``now`` as the month
    # has left plus the grace, whatever Redis's clock says (``now`` may be injected).
    return max(1, int((_month_bounds(month)[1] + MONTH_KEY_GRACE - now).total_seconds()))


# --------------------------------------------------------------------------- the month


def _ledger_spent(key_id: int, month: date) -> Decimal:
    start, end = _month_bounds(month)
    total = UsageRecord.objects.filter(client_key_id=key_id, created_at__gte=start, created_at__lt=end).aggregate(
        total=Sum("cost_usd")
    )["total"]
    return total or Decimal(0)


def _initialise(key: ClientKey, month: date, now: datetime, client: redis.Redis) -> None:
    """The month from the ledger, if Redis still lacks it. Rows still waiting in the ledger's
    outbox (the last seconds of traffic) are not in the sum: after a restart of Redis they
    were lost with the counter anyway; on first use they are missed (documented)."""
    spent = _ledger_spent(key.pk, month)
    created = _scripts(client).initialise(
        keys=_month_keys(key.pk, month), args=[_to_pico(spent), _month_ttl_s(month, now)], client=client
    )
    if created and key.monthly_budget_usd:
        # Alerts the ledger's spending already earned (their rows exist unless lost with Redis).
        for threshold in ALERT_THRESHOLDS:
            if spent * 100 >= key.monthly_budget_usd * threshold:
                _alert(key.pk, key.masked, month, threshold, spent, key.monthly_budget_usd)


def _alert(key_id: int, label: str, month: date, threshold: int, spent: Decimal, budget: Decimal) -> None:
    _, created = BudgetAlert.objects.get_or_create(
        client_key_id=key_id,
        month=month,
        threshold_percent=threshold,
        defaults={"spent_usd": spent, "budget_usd": budget},
    )
    if created:
        logger.warning(
            "client key %s (id %s) reached %s %% of its monthly budget for %s: $%s spent of $%s",
            label,
            key_id,
            threshold,
            f"{month:%Y-%m}",
            _usd(spent),
            _usd(budget),
        )


# --------------------------------------------------------------------------- the API


def admission_reserve(
    key: ClientKey, *, model: str, local: bool, prompt_tokens: int, max_tokens: int, now: datetime | None = None
) -> Admission:
    """Admit a request of ``key`` or raise ``LimitExceeded``: its requests and tokens per
    minute (tokens: ``prompt_tokens + max_tokens``, corrected at settlement) and its month's
    budget (the maximum cost reserved at the price of ``model`` in force ``now``; ``local``:
    served by the local pool, whose price applies to a model without its own). The
    admission must be settled (``admission_settle``) or released (``admission_release``) once."""
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError("prompt_tokens and max_tokens must not be negative")
    now = _now(now)
    month = _month_of(now)
    estimate = prompt_tokens + max_tokens
    budget = key.monthly_budget_usd
    reserved = None
    if budget is not None:
        price = price_at(model, now, local=local)
        if price is None:
            raise ModelUnpriced(
                f"model '{model}' has no price in force on {now:%Y-%m-%d %H:%M} UTC, so its requests cannot be "
                f"charged to the monthly budget of ${_usd(budget)} of key {key.masked}: add a price for '{model}' "
                "(admin: Billing, Prices)"
            )
        reserved = cost_of(prompt_tokens, max_tokens, price)
    windowed = key.requests_per_minute is not None or key.tokens_per_minute is not None
    admission = Admission(
        reservation_id=uuid.uuid4().hex,
        reserved_usd=reserved,
        estimated_tokens=estimate,
        key_id=key.pk,
        month=month,
        budget_usd=budget,
        windowed=windowed,
        admitted_at=now,
        key_label=key.masked,
    )
    if budget is None and not windowed:
        return admission  # nothing to count before the request; settle still counts its cost

    client = redis_client(Role.LIMITS)
    now_us = _micros(now)
    args = [
        admission.reservation_id,
        now_us,
        now_us - WINDOW_S * 1_000_000,
        "" if key.requests_per_minute is None else key.requests_per_minute,
        "" if key.tokens_per_minute is None else key.tokens_per_minute,
        estimate,
        WINDOW_KEY_TTL_MS,
        "" if budget is None else _to_pico(budget),
        0 if reserved is None else _to_pico(reserved),
        now_us + int(reservation_ttl_s() * 1_000_000),
        _month_ttl_s(month, now),
    ]
    keys = _window_keys(key.pk) + _month_keys(key.pk, month)
    for _ in range(3):  # the month is missing at most once, unless Redis keeps losing it
        result = _scripts(client).admit(keys=keys, args=args, client=client)
        outcome = result[0].decode()
        if outcome != "init":
            break
        _initialise(key, month, now, client)
    else:
        raise RuntimeError(f"the budget of key {key.masked} for {month:%Y-%m} vanished from Redis three times")

    if outcome == "ok":
        return admission
    if outcome == "budget":
        spent, committed, in_flight = _from_pico(result[1]), _from_pico(result[2]), int(result[3])
        if spent >= budget:
            raise LimitExceeded(
                "budget_exhausted",
                402,
                f"the monthly budget of ${_usd(budget)} of key {key.masked} is spent for {month:%Y-%m}: "
                f"${_usd(spent)} spent; it renews on {_next_month(month):%Y-%m-%d} (UTC)",
            )
        raise LimitExceeded(
            "rate_limited",
            429,
            f"the monthly budget of ${_usd(budget)} of key {key.masked} is held for {month:%Y-%m} by its "
            f"requests in flight ({in_flight}): ${_usd(spent)} spent and ${_usd(committed - spent)} reserved; "
            "retry when they finish",
            HELD_RETRY_AFTER_S,
        )
    count, retry_us = int(result[1]), int(result[2])
    retry_after = None if retry_us < 0 else retry_us / 1_000_000
    if outcome == "rpm":
        if retry_after is None:
            message = f"key {key.masked} allows 0 requests per minute"
        else:
            message = (
                f"key {key.masked} allows {key.requests_per_minute} requests per minute and made {count} "
                f"in the last {WINDOW_S} s; retry in {retry_after:.3f} s"
            )
        raise LimitExceeded("rate_limited", 429, message, retry_after)
    if retry_after is None:
        message = (
            f"this request needs {estimate} tokens (prompt {prompt_tokens} + max_tokens {max_tokens}), more than "
            f"the {key.tokens_per_minute} tokens per minute key {key.masked} allows: lower max_tokens"
        )
    else:
        message = (
            f"key {key.masked} allows {key.tokens_per_minute} tokens per minute and used {count} in the last "
            f"{WINDOW_S} s; this request needs {estimate} (prompt {prompt_tokens} + max_tokens {max_tokens}); "
            f"retry in {retry_after:.3f} s"
        )
    raise LimitExceeded("rate_limited", 429, message, retry_after)


def admission_settle(
    admission: Admission, *, actual_cost_usd: Decimal | None, actual_tokens: int, now: datetime | None = None
) -> None:
    """The request ran: its reservation is replaced by ``actual_cost_usd`` (None: unknown,
    and the reservation is charged, the most it could have cost) and its estimated tokens
    by ``actual_tokens`` (while it is still in the minute's window). Once per reservation:
    a second call does nothing."""
    if actual_tokens < 0:
        raise ValueError("actual_tokens must not be negative")
    now = _now(now)
    cost = actual_cost_usd if actual_cost_usd is not None else admission.reserved_usd
    now_us = _micros(now)
    client = redis_client(Role.LIMITS)
    result = _scripts(client).settle(
        keys=[
            *_window_keys(admission.key_id),
            *_month_keys(admission.key_id, admission.month),
            _settled_key(admission.key_id, admission.reservation_id),
        ],
        args=[
            admission.reservation_id,
            now_us,
            now_us - WINDOW_S * 1_000_000,
            "1" if admission.windowed else "",
            actual_tokens,
            WINDOW_KEY_TTL_MS,
            0 if cost is None else _to_pico(cost),
            SETTLED_MARKER_TTL_S,
        ],
        client=client,
    )
    if result[0].decode() != "settled" or not admission.budget_usd:
        return
    before, after = int(result[1]), int(result[2])
    budget = _to_pico(admission.budget_usd)
    for threshold in ALERT_THRESHOLDS:
        # Crossed by this settlement: exactly one settlement crosses each threshold.
        if before * 100 < budget * threshold <= after * 100:
            _alert(
                admission.key_id,
                admission.key_label,
                admission.month,
                threshold,
                _from_pico(after),
                admission.budget_usd,
            )


def admission_release(admission: Admission, *, now: datetime | None = None) -> None:
    """The request never ran (refused later, its enqueue failed): it costs nothing."""
    admission_settle(admission, actual_cost_usd=Decimal(0), actual_tokens=0, now=now)


def budget_state(key: ClientKey, *, now: datetime | None = None) -> BudgetState:
    """The month's spending and outstanding reservations as Redis counts them (initialised
    from the ledger if missing)."""
    now = _now(now)
    month = _month_of(now)
    client = redis_client(Role.LIMITS)
    keys = _month_keys(key.pk, month)
    for _ in range(3):
        view = _scripts(client).view(keys=keys, args=[_micros(now)], client=client)
        if view:
            spent, committed = _from_pico(view[0]), _from_pico(view[1])
            return BudgetState(month, spent, committed - spent, int(view[2]), key.monthly_budget_usd)
        _initialise(key, month, now, client)
    raise RuntimeError(f"the budget of key {key.masked} for {month:%Y-%m} vanished from Redis three times")


def month_spent(key: ClientKey, *, now: datetime | None = None) -> Decimal:
    """What ``key`` spent this month (UTC), settled requests only."""
    return budget_state(key, now=now).spent_usd
