"""Every periodic job, in one place (Celery beat reads this through ``ragsite.celery``)."""

from __future__ import annotations

# Where the heartbeat job leaves its last run's time, for /readyz (frontdoors/readiness.py).
BEAT_HEARTBEAT_KEY = "ragsite:beat:heartbeat"

BEAT_SCHEDULE = {
    # Lets /readyz and operators see that beat itself is alive.
    "beat-heartbeat": {
        "task": "ragsite.tasks.beat_heartbeat",
        "schedule": 30.0,
        "options": {"expires": 30},
    },
    # Deletes audit events past AUDIT_RETENTION_DAYS (ragsite/audit.py).
    "audit-purge": {
        "task": "ragsite.tasks.audit_purge",
        "schedule": 86400.0,
        "options": {"expires": 86400},
    },
    # Creates the BM25 HNSW index once the chunk table is large (search/vector_indexes.py).
    "search-indexes-maintain": {
        "task": "search.tasks.search_indexes_maintain",
        "schedule": 3600.0,
        "options": {"expires": 3600},
    },
    # Judges live canary releases window by window; rolls back or steps them (inference/canary.py).
    "canary-analyse": {
        "task": "inference.tasks.canary_analyse",
        "schedule": 60.0,
        "options": {"expires": 60},
    },
    # Fails answers whose generation's message was lost, an hour after they were asked
    # (search/answering/answers.py answers_reap; every other end comes through the ledger's drain).
    "answers-reap": {
        "task": "search.tasks.answers_reap",
        "schedule": 300.0,
        "options": {"expires": 300},
    },
    # Publishes again the generations whose message a killed worker took and lost before it
    # recorded it (inference/pending.py): within seconds, where answers-reap fails them in an hour.
    "generations-lost-requeue": {
        "task": "inference.tasks.generations_lost_requeue",
        "schedule": 10.0,
        "options": {"expires": 10},
    },
    # Stores queued usage-ledger rows and hands their outcomes to the answers waiting, taking
    # over entries a drainer read and never acknowledged (billing/ledger.py).
    "ledger-drain": {
        "task": "billing.tasks.ledger_drain",
        "schedule": 15.0,
        "options": {"expires": 15},
    },
}
