"""Prices and costs, in exact decimal arithmetic (``Decimal`` here, ``numeric`` in SQL).

A row's price is the model's latest ``Price`` whose ``effective_from`` is at or before the
row's time; for a model served by a ``local`` provider without a price of its own, the
``local`` pool's price. No price: the cost is None (unknown), never 0.

    cost = (prompt_tokens * input_usd_per_million + completion_tokens * output_usd_per_million) / 1,000,000

exact to 12 decimals (prices have 6), the precision of ``UsageRecord.cost_usd``. The ledger
computes the same expression in SQL when it stores a row (``billing.ledger``);
``cost_of`` is the Python twin for reservations, estimates and tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from billing.models import Price
from ragsite.rows import Rows, fetch_one

MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class Cost:
    usd: Decimal
    price: Price


@functools.cache
def _price_statement() -> tuple[Rows, str]:
    rows = Rows((Price, "price"))
    return rows, (
        f"SELECT {rows.columns} FROM {Price._meta.db_table} price "  # noqa: S608
        "WHERE price.effective_from <= %(at)s AND (price.model = %(model)s OR (%(local)s AND price.model = %(pool)s)) "
        "ORDER BY (price.model = %(model)s) DESC, price.effective_from DESC LIMIT 1"
    )


def price_at(model: str, at: datetime, *, local: bool = False) -> Price | None:
    """The price of ``model`` in force at ``at`` (the local pool's when ``local`` and the
    model has none). One prepared statement (``ragsite.rows``): a key with a budget admits
    every request at its model's price, on the way to its first token."""
    rows, sql = _price_statement()
    row = fetch_one(sql, {"at": at, "model": model, "local": local, "pool": Price.LOCAL_POOL})
    return rows.instances(row)[0] if row is not None else None


def cost_of(prompt_tokens: int, completion_tokens: int, price: Price) -> Decimal:
    return (
        Decimal(prompt_tokens) * price.input_usd_per_million + Decimal(completion_tokens) * price.output_usd_per_million
    ) / MILLION


# The SQL twin, for ``billing.ledger``: the price of each stored row (``r``: its model, its
# provider's kind, its time), as a LATERAL subquery.
PRICE_LATERAL = """
LEFT JOIN LATERAL (
    SELECT price.id, price.input_usd_per_million, price.output_usd_per_million
    FROM billing_price price
    WHERE price.effective_from <= r.created_at
      AND (price.model = r.model OR (price.model = 'local' AND provider.kind = 'local'))
    ORDER BY (price.model = r.model) DESC, price.effective_from DESC
    LIMIT 1
) price ON true
"""
