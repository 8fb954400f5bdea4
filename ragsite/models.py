"""What a person chose for the site itself, kept with their account rather than in one browser.

The platform's layer, below every app: a preference belongs to the user, whichever door they
come through, and the layers above read it without importing each other.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from ragsite.audit import Action


class UserPreference(models.Model):
    """One row per user who chose something. ``language``: a code of ``settings.LANGUAGES``,
    empty for the browser's (Accept-Language). The codes are checked where a choice is made
    (``frontdoors/ui/languages.py``), not as field choices, so adding a language to
    ``LANGUAGES`` needs no migration."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="preference")
    language = models.CharField(max_length=16, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.user}: {self.language or 'browser language'}"


class AuditEvent(models.Model):
    """Who did what, when, from where, and how it ended (ragsite.audit): append-only.

    No foreign keys: a deleted user or key keeps its events, which name it as they did
    (``actor``, ``actor_name``). The database refuses any UPDATE, and any DELETE of an event
    younger than ``ragsite.audit.RETENTION_FLOOR_DAYS`` (the trigger of migration 0002), whoever asks."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    action = models.CharField(max_length=32, choices=Action.choices)
    # "user:<id>", "key:<id>", "operator" (a management command) or "anonymous".
    actor = models.CharField(max_length=64)
    actor_name = models.CharField(max_length=200, blank=True)  # the username or key name, then
    workspace_id = models.BigIntegerField(null=True, blank=True)
    target = models.CharField(max_length=100, blank=True)  # "document:12", "key:3"
    outcome = models.CharField(max_length=16, default="ok")  # ok, refused, failed, not_found
    client_ip = models.GenericIPAddressField(null=True, blank=True)
    user_agent = models.CharField(max_length=300, blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    detail = models.JSONField(default=dict, blank=True)  # the query, the question, readers before/after

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["actor", "at"], name="audit_actor_at")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target} {self.outcome}"
