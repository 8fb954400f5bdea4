"""Every periodic job, in one place (Celery beat reads this through ``ragsite.celery``)."""

from __future__ import annotations

BEAT_SCHEDULE = {
    # Lets /readyz and operators see that beat itself is alive.
    "beat-heartbeat": {
        "task": "ragsite.tasks.beat_heartbeat",
        "schedule": 30.0,
        "options": {"expires": 30},
    },
}
