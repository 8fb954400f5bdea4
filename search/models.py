"""Tenants and their documents.

A ``Workspace`` is the tenant boundary: every collection, document, answer and key
belongs to exactly one, and every query filters by it.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Workspace(models.Model):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=100, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, through="Membership", related_name="workspaces")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        MEMBER = "member", "Member"

    workspace = models.ForeignKey(Workspace, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["workspace", "user"], name="membership_unique_user")]

    def __str__(self) -> str:
        return f"{self.user} in {self.workspace} ({self.role})"


class Collection(models.Model):
    workspace = models.ForeignKey(Workspace, on_delete=models.CASCADE, related_name="collections")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["workspace", "name"], name="collection_unique_name")]

    def __str__(self) -> str:
        return f"{self.workspace.slug}/{self.name}"


class Document(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        PARSING = "parsing", "Parsing"
        CHUNKING = "chunking", "Chunking"
        EMBEDDING = "embedding", "Embedding"
        INDEXED = "indexed", "Indexed"
        FAILED = "failed", "Failed"

    collection = models.ForeignKey(Collection, on_delete=models.CASCADE, related_name="documents")
    title = models.CharField(max_length=500)
    source_name = models.CharField(max_length=500, help_text="The file name as uploaded.")
    media_type = models.CharField(max_length=100)
    file = models.FileField(upload_to="documents/%Y/%m/", max_length=500)
    size_bytes = models.PositiveBigIntegerField(default=0)
    # SHA-256 of the uploaded bytes until the text is parsed; of the normalised text after.
    sha256 = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    error = models.TextField(blank=True, help_text="Why ingestion failed, for operators.")
    metadata = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["collection", "sha256"], name="document_unique_content"),
        ]

    def __str__(self) -> str:
        return self.title
