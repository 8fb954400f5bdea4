"""Which database a read goes to."""

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper

REPLICA = "replica"


def reads_alias() -> str:
    """The read replica where one is configured (``DATABASE_REPLICA_URL``), else the primary:
    for reads that may lag the primary by the replication delay (search's ranking, the
    dashboards' reports; docs/scaling.md)."""
    return REPLICA if REPLICA in settings.DATABASES else DEFAULT_DB_ALIAS


def reads() -> BaseDatabaseWrapper:
    return connections[reads_alias()]
