"""Every periodic job, in one place (Celery beat reads this through ``ragsite.celery``)."""

from __future__ import annotations

BEAT_SCHEDULE = {
    # Lets /readyz and operators see that beat itself is alive.
    "beat-heartbeat": {
        "task": "ragsite.tasks.beat_heartbeat",
        "schedule": 30.0,
        "options": {"expires": 30},
    },
    # Creates the BM25 HNSW index once the chunk table is large (search/vector_indexes.py).
    "search-indexes-maintain": {
        "task": "search.tasks.search_indexes_maintain",
        "schedule": 3600.0,
        "options": {"expires": 3600},
    },
}
