"""What a person chose for the site itself, kept with their account rather than in one browser.

The platform's layer, below every app: a preference belongs to the user, whichever door they
come through, and the layers above read it without importing each other.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


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
