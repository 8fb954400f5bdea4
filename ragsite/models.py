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


class Identity(models.Model):
    """A user as their identity provider knows them: the issuer and its subject, which stay
    when an e-mail address or a name changes (OpenID Connect Core 5.7). A sign-in by single
    sign-on finds its user here and nowhere else: never by e-mail (ragsite.identity)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="identities")
    issuer = models.CharField(max_length=300)
    subject = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)
    signed_in_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="identity_unique_subject")]
        verbose_name_plural = "identities"

    def __str__(self) -> str:
        return f"{self.user} ({self.subject} at {self.issuer})"


class ProvidedGroup(models.Model):
    """A group whose members the identity provider says (its groups claim): on each sign-in a
    user's memberships of provided groups become exactly the claim's; groups made by hand
    are left as they are."""

    group = models.OneToOneField("auth.Group", on_delete=models.CASCADE, primary_key=True, related_name="provided")
    issuer = models.CharField(max_length=300)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.group} (from {self.issuer})"
