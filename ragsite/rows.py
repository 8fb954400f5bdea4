"""Model instances from hand-written SQL, for the statements every request of the APIs runs.

On that path, compiling an ORM query costs several times its round trip to PostgreSQL
(measured in ``benchmarks/worker_routing_cost.py``), and one statement can do the work of
several ORM calls (a route with its provider, its live canary release and a key; a client
key with its workspace). ``Rows`` lists the columns of several models for a SELECT and
turns a result row back into instances the way the ORM does (``Model.from_db`` and each
field's ``from_db_value``). Used by the routing statements (``inference.router``,
``inference.keypool``), the client key's check (``billing.client_keys``), the price a
budgeted key's request is admitted at (``billing.pricing``) and the collections of a
workspace an answer searches (``search.scoping``). ``insert_together`` writes new rows of
several tables in one statement (the ORM's own INSERTs, joined as data-modifying CTEs): an
answer with its conversation and collections (``search.answering.answers``).
"""

from __future__ import annotations

import django
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.backends.postgresql.base import DatabaseWrapper, ServerBindingCursor
from django.db.models import Model
from django.db.models.sql import InsertQuery

# ``cursor()`` wraps a server-binding cursor with Django's private ``_prepare_cursor``, as Django's
# own ``cursor()`` does, to keep its error wrapping and query logging: the one private API this
# module relies on, checked on the Django it was verified with (requirements.txt pins it).
_DJANGO_VERIFIED = (5, 2)
if django.VERSION[:2] != _DJANGO_VERIFIED or not hasattr(DatabaseWrapper, "_prepare_cursor"):
    raise ImproperlyConfigured(
        f"ragsite/rows.py uses Django's private DatabaseWrapper._prepare_cursor, verified on Django "
        f"{'.'.join(map(str, _DJANGO_VERIFIED))}; this is {django.get_version()}: check it and update _DJANGO_VERIFIED"
    )


class Rows:
    def __init__(self, *models_and_aliases):
        self.parts = [(model, alias, list(model._meta.concrete_fields)) for model, alias in models_and_aliases]
        self.columns = ", ".join(f"{alias}.{field.column}" for _, alias, fields in self.parts for field in fields)
        self.width = sum(len(fields) for _, _, fields in self.parts)

    def instances(self, row) -> list:
        """One instance per model, None where a LEFT JOIN found nothing (its first column,
        the primary key, is NULL). Columns after the models' are left for the caller."""
        made, offset = [], 0
        for model, _, fields in self.parts:
            values = row[offset : offset + len(fields)]
            offset += len(fields)
            if values[0] is None:
                made.append(None)
                continue
            values = [
                field.from_db_value(value, None, connection) if hasattr(field, "from_db_value") else value
                for field, value in zip(fields, values, strict=True)
            ]
            made.append(model.from_db(connection.alias, [field.attname for field in fields], values))
        return made


def insert_together(*groups: list[Model]) -> None:
    """INSERT each group's new instances (one model per group), all groups in one statement:
    atomic by itself, one round trip where ``transaction.atomic`` around one ``save`` each
    costs a BEGIN, a statement each and a COMMIT. Each INSERT is the one the ORM would send
    (every concrete column, values prepared by their fields), written as a data-modifying
    CTE; the foreign keys between them hold because Django makes every constraint DEFERRABLE
    INITIALLY DEFERRED (checked once the statement commits). An auto-incremented primary key
    left unset is the database's to assign, and is not read back. Sends no ``pre_save`` or
    ``post_save`` signals: for models that have no receivers."""
    parts, params = [], []
    for objs in (group for group in groups if group):
        model = type(objs[0])
        query = InsertQuery(model)
        fields = model._meta.local_concrete_fields
        if objs[0].pk is None:
            fields = [field for field in fields if field is not model._meta.auto_field]
        query.insert_values(fields, objs)
        [(sql, values)] = query.get_compiler(connection=connection).as_sql()
        parts.append(sql)
        params.extend(values)
    if not parts:
        return
    *ctes, last = parts
    sql = ("WITH " + ", ".join(f"w{i} AS ({cte})" for i, cte in enumerate(ctes)) + " " if ctes else "") + last
    with connection.cursor() as cursor_:
        cursor_.execute(sql, params)
    for group in groups:
        for obj in group:
            obj._state.adding, obj._state.db = False, connection.alias


def cursor():
    """A cursor for these statements: Django's (its error wrapping, query logging and
    counting), binding parameters on the server so that each statement is prepared on its
    first run in a connection and never planned again (planning the route-and-release join
    costs about three times executing it). Off with ``ROUTER_PREPARED_STATEMENTS=false``,
    for a connection pooler that keeps no prepared statements (PgBouncer in transaction
    mode before 1.21). Django's own cursors bind on the client and prepare nothing, so
    the connection's ``prepare_threshold`` set here changes only these."""
    if not settings.ROUTER_PREPARED_STATEMENTS:
        return connection.cursor()
    # As Django's own cursor(): a worker thread's connection outlives its tasks (ragsite/celery.py),
    # so the health check due after each task runs first, and a connection that broke meanwhile
    # (a PostgreSQL restart) is replaced rather than failing this statement.
    connection.close_if_health_check_failed()
    with connection.wrap_database_errors:
        connection.ensure_connection()
        raw = connection.connection
        if raw.prepare_threshold is None:
            raw.prepare_threshold = 0
        return connection._prepare_cursor(ServerBindingCursor(raw))


def fetch_one(sql: str, params):
    with cursor() as cursor_:
        cursor_.execute(sql, params)
        return cursor_.fetchone()


def fetch_all(sql: str, params) -> list:
    with cursor() as cursor_:
        cursor_.execute(sql, params)
        return cursor_.fetchall()
