"""Limits per client key (billing/limits.py) on real Redis and PostgreSQL: requests and
tokens per minute refused with an exact Retry-After, settlement correcting the tokens, a
monthly budget kept in exact integers of 1e-12 USD, parallel admissions overspending by at
most one reservation, the month initialised from the ledger, reservations that expire,
settlements counted once, and the 80 % and 100 % alerts created once each.

Time is injected (``now``), never slept: the outcomes are exact numbers.
"""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection

from billing import limits
from billing.limits import LimitExceeded, ModelUnpriced
from billing.models import BudgetAlert, ClientKey, Price, UsageRecord
from billing.pricing import cost_of
from ragsite.redis import Role, redis_client
from search.models import Workspace

pytestmark = pytest.mark.django_db(transaction=True)

T0 = datetime(2025, 6, 10, 12, 0, tzinfo=UTC)
# (100 * 0.123456 + 50 * 7.654321) / 1e6: the reservation of a 100-token prompt with max_tokens 50.
RESERVED = Decimal("0.00039506165")


def seconds(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


@pytest.fixture
def price():
    """A model of this test's own (seeded prices may have been flushed by another test)."""
    return Price.objects.create(
        model=f"test-model-{uuid.uuid4().hex[:8]}",
        input_usd_per_million=Decimal("0.123456"),
        output_usd_per_million=Decimal("7.654321"),
        effective_from=datetime(2025, 1, 1, tzinfo=UTC),
    )


@pytest.fixture
def make_key():
    """Keys with fresh ids (their Redis keys are namespaced by id), deleted from Redis after."""
    workspace = Workspace.objects.create(name="Limits", slug=f"limits-{uuid.uuid4().hex[:8]}")
    made: list[ClientKey] = []

    def factory(**limits_) -> ClientKey:
        key = ClientKey.objects.create(
            workspace=workspace,
            name=f"key {len(made)}",
            prefix=uuid.uuid4().hex[:8],
            secret_hash="0" * 64,
            last_four="abcd",
            **limits_,
        )
        made.append(key)
        return key

    yield factory
    client = redis_client(Role.LIMITS)
    for key in made:
        for name in client.scan_iter(match=f"limits:{{{key.pk}}}:*"):
            client.delete(name)


def ledger_row(key: ClientKey, cost: str | None, at: datetime = T0) -> UsageRecord:
    return UsageRecord.objects.create(
        client_key=key, status=UsageRecord.Status.OK, created_at=at, cost_usd=None if cost is None else Decimal(cost)
    )


def forget_month(key: ClientKey, month: str = "2025-06") -> None:
    """Redis loses the month (a restart without its append-only file)."""
    base = f"limits:{{{key.pk}}}:{month}"
    redis_client(Role.LIMITS).delete(base, f"{base}:held", f"{base}:amounts")


def admit(key: ClientKey, price: Price, at: datetime = T0, *, prompt: int = 100, max_tokens: int = 50):
    return limits.admission_reserve(
        key, model=price.model, local=False, prompt_tokens=prompt, max_tokens=max_tokens, now=at
    )


def refusal(key: ClientKey, price: Price, at: datetime = T0, **kwargs) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as caught:
        admit(key, price, at, **kwargs)
    return caught.value


# --------------------------------------------------------------------------- budget


def test_reservations_and_settlements_are_exact_integers_of_a_picodollar(price, make_key):
    key = make_key(monthly_budget_usd=Decimal("10.00"))

    first = admit(key, price)
    second = admit(key, price, prompt=7, max_tokens=3)

    assert first.reserved_usd == RESERVED
    assert second.reserved_usd == Decimal("0.000023827155")  # (7 * 0.123456 + 3 * 7.654321) / 1e6
    assert (first.estimated_tokens, first.key_id, first.month) == (150, key.pk, T0.date().replace(day=1))
    state = limits.budget_state(key, now=T0)
    assert (state.spent_usd, state.reserved_usd, state.in_flight) == (0, Decimal("0.000418888805"), 2)

    actual = cost_of(100, 20, price)
    assert actual == Decimal("0.00016543202")
    limits.admission_settle(first, actual_cost_usd=actual, actual_tokens=120, now=seconds(1))

    state = limits.budget_state(key, now=seconds(1))
    assert (state.spent_usd, state.reserved_usd, state.in_flight) == (actual, second.reserved_usd, 1)
    # Stored as integers of 1e-12 USD, never as floats.
    month = redis_client(Role.LIMITS).hgetall(f"limits:{{{key.pk}}}:2025-06")
    assert month == {b"spent": b"165432020", b"committed": b"189259175"}

    limits.admission_release(second, now=seconds(2))

    state = limits.budget_state(key, now=seconds(2))
    assert (state.spent_usd, state.reserved_usd, state.in_flight) == (actual, 0, 0)
    assert limits.month_spent(key, now=seconds(2)) == actual


def test_a_cost_finer_than_a_picodollar_is_refused_not_rounded(price, make_key):
    admission = admit(make_key(monthly_budget_usd=Decimal("1.00")), price)

    with pytest.raises(ValueError, match="finer than 1e-12 USD"):
        limits.admission_settle(admission, actual_cost_usd=Decimal("0.0000000000001"), actual_tokens=1, now=T0)


@pytest.mark.parametrize(
    ("spent", "admitted"),
    [("1.000000000000", False), ("0.999999999999", True)],
    ids=["spent-equals-budget", "one-picodollar-below"],
)
def test_the_budget_boundary(price, make_key, spent, admitted):
    key = make_key(monthly_budget_usd=Decimal("1.00"))
    ledger_row(key, spent)

    if admitted:
        assert admit(key, price).reserved_usd == RESERVED
        assert limits.budget_state(key, now=T0).reserved_usd == RESERVED
    else:
        refused = refusal(key, price)
        assert (refused.code, refused.status, refused.retry_after_s) == ("budget_exhausted", 402, None)
        assert refused.message == (
            f"the monthly budget of $1 of key {key.masked} is spent for 2025-06: $1 spent; "
            "it renews on 2025-07-01 (UTC)"
        )
        assert limits.budget_state(key, now=T0).in_flight == 0


def test_twenty_parallel_requests_overspend_by_at_most_one_reservation(price, make_key):
    key = make_key(monthly_budget_usd=Decimal("1.00"))
    # 2.5 reservations left: admitted while spent + reserved < budget, so exactly three.
    spent_before = Decimal("1.00") - Decimal("2.5") * RESERVED
    ledger_row(key, str(spent_before))
    start, admitted_all = threading.Barrier(20), threading.Barrier(20)
    admitted, refused, errors = [], [], []
    lock = threading.Lock()

    def request() -> None:
        try:
            start.wait()
            # Each thread its own view of the key and its own connection, as a web process.
            own_key = ClientKey.objects.get(pk=key.pk)
            try:
                admission = admit(own_key, price)
            except LimitExceeded as exc:
                admission = None
                with lock:
                    refused.append(exc)
            else:
                with lock:
                    admitted.append(admission)
            admitted_all.wait()  # settle only once every admission was decided
            if admission is not None:
                limits.admission_settle(
                    admission, actual_cost_usd=admission.reserved_usd, actual_tokens=150, now=seconds(1)
                )
        except Exception as exc:  # reported below: an assertion here would die with its thread
            with lock:
                errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=request) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert (len(admitted), len(refused)) == (3, 17)
    # Refused while the remainder was held by requests in flight, not yet spent: retry soon.
    assert {(exc.code, exc.status, exc.retry_after_s) for exc in refused} == {("rate_limited", 429, 1.0)}
    spent = limits.month_spent(key, now=seconds(1))
    assert spent == spent_before + 3 * RESERVED == Decimal("1.000197530825")
    assert spent - Decimal("1.00") == RESERVED / 2 < RESERVED
    assert refusal(key, price, seconds(2)).code == "budget_exhausted"


def test_the_month_is_initialised_from_the_ledger_when_redis_lost_it(price, make_key):
    key, other = make_key(monthly_budget_usd=Decimal("5.00")), make_key()
    ledger_row(key, "0.1")
    ledger_row(key, "0.000000000001", at=datetime(2025, 6, 30, 23, 59, 59, 999999, tzinfo=UTC))
    ledger_row(key, None)  # unpriced: unknown, not 0, and not counted
    ledger_row(key, "7", at=datetime(2025, 5, 31, 23, 59, 59, tzinfo=UTC))  # last month
    ledger_row(key, "7", at=datetime(2025, 7, 1, tzinfo=UTC))  # next month
    ledger_row(other, "7")

    assert limits.month_spent(key, now=T0) == Decimal("0.100000000001")
    assert limits.month_spent(key, now=datetime(2025, 5, 2, tzinfo=UTC)) == 7

    admission = admit(key, price)
    limits.admission_settle(admission, actual_cost_usd=RESERVED, actual_tokens=150, now=seconds(1))
    assert limits.month_spent(key, now=seconds(1)) == Decimal("0.100000000001") + RESERVED

    # Redis restarts; the drain had stored the settled request's row meanwhile.
    forget_month(key)
    ledger_row(key, str(RESERVED))
    assert limits.month_spent(key, now=seconds(2)) == Decimal("0.100000000001") + RESERVED

    # A settlement while the month is missing adds nothing: its ledger row will count it.
    late = admit(key, price, seconds(3))
    forget_month(key)
    limits.admission_settle(late, actual_cost_usd=RESERVED, actual_tokens=150, now=seconds(4))
    assert not redis_client(Role.LIMITS).exists(f"limits:{{{key.pk}}}:2025-06")
    ledger_row(key, str(RESERVED))
    state = limits.budget_state(key, now=seconds(5))
    assert (state.spent_usd, state.reserved_usd) == (Decimal("0.100000000001") + 2 * RESERVED, 0)


def test_a_second_settlement_of_the_same_request_does_nothing(price, make_key):
    key = make_key(monthly_budget_usd=Decimal("1.00"), tokens_per_minute=1000)
    admission = admit(key, price)

    for _ in range(2):
        limits.admission_settle(admission, actual_cost_usd=Decimal("0.0001"), actual_tokens=60, now=seconds(1))
    limits.admission_release(admission, now=seconds(2))

    state = limits.budget_state(key, now=seconds(2))
    assert (state.spent_usd, state.reserved_usd, state.in_flight) == (Decimal("0.0001"), 0, 0)
    assert redis_client(Role.LIMITS).get(f"limits:{{{key.pk}}}:window:token_sum") == b"60"


def test_an_unsettled_reservation_stops_counting_when_it_expires(price, make_key):
    key = make_key(monthly_budget_usd=Decimal("1.00"))
    ledger_row(key, "0.9999")  # room for one reservation in flight
    crashed = admit(key, price)
    expiry = T0 + timedelta(seconds=limits.reservation_ttl_s())

    held = refusal(key, price, seconds(1))
    assert (held.code, held.status, held.retry_after_s) == ("rate_limited", 429, 1.0)
    assert "held for 2025-06 by its requests in flight (1): $0.9999 spent and $0.00039506165 reserved" in held.message
    assert refusal(key, price, expiry - timedelta(microseconds=1)).code == "rate_limited"

    later = admit(key, price, expiry)
    state = limits.budget_state(key, now=expiry)
    assert (state.spent_usd, state.reserved_usd, state.in_flight) == (Decimal("0.9999"), RESERVED, 1)

    # Its process comes back and settles after all: what it spent counts, once.
    limits.admission_settle(crashed, actual_cost_usd=RESERVED, actual_tokens=150, now=expiry + timedelta(seconds=1))
    state = limits.budget_state(key, now=expiry + timedelta(seconds=1))
    assert (state.spent_usd, state.reserved_usd, state.in_flight) == (Decimal("0.9999") + RESERVED, RESERVED, 1)
    limits.admission_release(later, now=expiry + timedelta(seconds=2))
    assert limits.budget_state(key, now=expiry + timedelta(seconds=2)).reserved_usd == 0


def test_a_request_admitted_at_the_end_of_a_month_is_charged_to_that_month(price, make_key):
    key = make_key(monthly_budget_usd=Decimal("1.00"))
    june_end = datetime(2025, 6, 30, 23, 59, 59, tzinfo=UTC)
    admission = admit(key, price, june_end)
    july = datetime(2025, 7, 1, 0, 0, 5, tzinfo=UTC)

    limits.admission_settle(admission, actual_cost_usd=RESERVED, actual_tokens=150, now=july)

    assert admission.month.isoformat() == "2025-06-01"
    assert limits.month_spent(key, now=june_end) == RESERVED
    assert limits.month_spent(key, now=july) == 0


def test_alerts_at_80_and_100_percent_are_created_once_each(price, make_key, caplog):
    key = make_key(monthly_budget_usd=Decimal("1.00"))
    caplog.set_level(logging.WARNING, logger="billing.limits")

    for step, cost in enumerate(["0.5", "0.3", "0.1", "0.1"]):  # 50 %, 80 %, 90 %, 100 %
        admission = admit(key, price, seconds(step), prompt=1, max_tokens=1)
        limits.admission_settle(admission, actual_cost_usd=Decimal(cost), actual_tokens=2, now=seconds(step))
    assert refusal(key, price, seconds(5)).code == "budget_exhausted"

    alerts = list(BudgetAlert.objects.filter(client_key=key).order_by("threshold_percent"))
    assert [(a.threshold_percent, a.spent_usd, a.budget_usd, a.month.isoformat()) for a in alerts] == [
        (80, Decimal("0.8"), Decimal("1.00"), "2025-06-01"),
        (100, Decimal("1.0"), Decimal("1.00"), "2025-06-01"),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"client key {key.masked} (id {key.pk}) reached 80 % of its monthly budget for 2025-06: $0.8 spent of $1",
        f"client key {key.masked} (id {key.pk}) reached 100 % of its monthly budget for 2025-06: $1 spent of $1",
    ]
    assert not any(key.secret_hash in message for message in warnings)

    # Redis loses the month; the ledger has the spending: no alert a second time.
    forget_month(key)
    ledger_row(key, "1.0")
    assert limits.month_spent(key, now=seconds(6)) == 1
    assert BudgetAlert.objects.filter(client_key=key).count() == 2
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_an_unpriced_model_cannot_be_budgeted(price, make_key):
    key = make_key(monthly_budget_usd=Decimal("1.00"))

    with pytest.raises(ModelUnpriced) as caught:
        limits.admission_reserve(key, model="no-such-model-42", local=False, prompt_tokens=10, max_tokens=10, now=T0)

    assert isinstance(caught.value, LimitExceeded)
    assert (caught.value.code, caught.value.status, caught.value.retry_after_s) == ("model_unpriced", 402, None)
    assert "model 'no-such-model-42' has no price" in caught.value.message
    assert limits.budget_state(key, now=T0).in_flight == 0
    # Served by the local pool, a model without its own price has the pool's.
    Price.objects.create(
        model=Price.LOCAL_POOL,
        input_usd_per_million=Decimal("0.02"),
        output_usd_per_million=Decimal("0.10"),
        effective_from=datetime(2025, 6, 1, tzinfo=UTC),
    )
    pooled = limits.admission_reserve(
        key, model="no-such-model-42", local=True, prompt_tokens=10, max_tokens=10, now=T0
    )
    assert pooled.reserved_usd == Decimal("0.0000012")
    # A key without a budget has nothing to reserve: the model's price does not matter.
    free = limits.admission_reserve(
        make_key(), model="no-such-model-42", local=False, prompt_tokens=10, max_tokens=10, now=T0
    )
    assert free.reserved_usd is None


def test_the_price_in_force_is_the_models_latest_then_the_pools(db):
    from billing.pricing import price_at

    def price(model: str, day: int, usd: str) -> Price:
        return Price.objects.create(
            model=model,
            input_usd_per_million=Decimal(usd),
            output_usd_per_million=Decimal(usd),
            effective_from=datetime(2025, 6, day, tzinfo=UTC),
        )

    old, current, _future = price("m-7b", 1, "1"), price("m-7b", 5, "2"), price("m-7b", 20, "3")
    pool_current = price(Price.LOCAL_POOL, 9, "0.5")  # newer than the model's own: its own still wins
    assert price_at("m-7b", T0).pk == current.pk
    assert price_at("m-7b", T0, local=True).pk == current.pk
    assert price_at("m-7b", datetime(2025, 6, 2, tzinfo=UTC)).pk == old.pk
    assert price_at("m-7b", datetime(2025, 5, 1, tzinfo=UTC)) is None
    assert price_at("other", T0) is None
    assert price_at("other", T0, local=True).pk == pool_current.pk
    assert price_at("other", T0, local=True).input_usd_per_million == Decimal("0.5")


# --------------------------------------------------------------------------- per minute


def test_requests_per_minute(price, make_key):
    key = make_key(requests_per_minute=3, monthly_budget_usd=Decimal("1.00"))
    for at in (0, 1, 2):
        admit(key, price, seconds(at))

    refused = refusal(key, price, seconds(10))

    assert (refused.code, refused.status, refused.retry_after_s) == ("rate_limited", 429, 50.0)
    assert refused.message == (
        f"key {key.masked} allows 3 requests per minute and made 3 in the last 60 s; retry in 50.000 s"
    )
    # A refused request took nothing: no entry in the window, no reservation.
    assert limits.budget_state(key, now=seconds(10)).in_flight == 3
    assert redis_client(Role.LIMITS).zcard(f"limits:{{{key.pk}}}:window") == 3
    # The first request leaves the window 60 s after it came; the second 1 s later.
    admit(key, price, seconds(60))
    assert refusal(key, price, seconds(60)).retry_after_s == 1.0
    admit(key, price, seconds(61))


def test_tokens_per_minute_count_the_estimate_and_settlement_corrects_it(price, make_key):
    key = make_key(tokens_per_minute=1000)
    token_sum = f"limits:{{{key.pk}}}:window:token_sum"
    first = admit(key, price, seconds(0), prompt=100, max_tokens=300)
    admit(key, price, seconds(5), prompt=100, max_tokens=300)
    assert redis_client(Role.LIMITS).get(token_sum) == b"800"

    refused = refusal(key, price, seconds(10), prompt=100, max_tokens=300)
    assert (refused.code, refused.status, refused.retry_after_s) == ("rate_limited", 429, 50.0)
    assert "allows 1000 tokens per minute and used 800" in refused.message
    assert "needs 400 (prompt 100 + max_tokens 300)" in refused.message

    # The first request used 150 tokens, not 400: 250 come back.
    limits.admission_settle(first, actual_cost_usd=None, actual_tokens=150, now=seconds(11))
    assert redis_client(Role.LIMITS).get(token_sum) == b"550"
    admit(key, price, seconds(12), prompt=100, max_tokens=300)
    assert redis_client(Role.LIMITS).get(token_sum) == b"950"
    # 60 more need 10 to leave: the first request's 150, at 60 s.
    assert refusal(key, price, seconds(13), prompt=10, max_tokens=50).retry_after_s == 47.0
    admit(key, price, seconds(60), prompt=10, max_tokens=50)
    assert redis_client(Role.LIMITS).get(token_sum) == b"860"

    # More than a minute's allowance can never be admitted: no Retry-After.
    never = refusal(key, price, seconds(60), prompt=900, max_tokens=200)
    assert (never.code, never.status, never.retry_after_s) == ("rate_limited", 429, None)
    assert "needs 1100 tokens (prompt 900 + max_tokens 200), more than the 1000 tokens per minute" in never.message


def test_a_key_without_limits_touches_no_redis_key_before_the_request(price, make_key):
    key = make_key()

    admission = admit(key, price)

    assert (admission.reserved_usd, admission.windowed) == (None, False)
    assert list(redis_client(Role.LIMITS).scan_iter(match=f"limits:{{{key.pk}}}:*")) == []
    # Its spending is still counted once the month is tracked (a budget set in mid-month).
    assert limits.month_spent(key, now=T0) == 0
    limits.admission_settle(admission, actual_cost_usd=RESERVED, actual_tokens=150, now=seconds(1))
    assert limits.month_spent(key, now=seconds(1)) == RESERVED
