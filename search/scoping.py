"""Tenant data is read through one door: each tenant model declares the path from its rows to
their workspace (``workspace_path``), and ``in_workspaces`` derives every queryset a front door
reads from it. The REST API's views (``ApiView.scoped``), the OpenAI-compatible API and the
browser UI read tenant rows only this way (``tests/security/test_tenant_isolation.py`` checks
that no front-door module queries a tenant model directly), so a view cannot forget the filter.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Model, QuerySet

from search.models import Workspace


def workspaces_visible_to(user) -> QuerySet:
    """The workspaces a logged-in user reads, the same in the browser UI and the REST API
    (session auth): their memberships; a superuser (the operator who set the system up) has
    them all, so that a fresh install's first administrator searches the demo corpus at once.
    An API key reads its own workspace only, whoever created it (docs/api.md)."""
    if user.is_superuser:
        return Workspace.objects.all()
    return Workspace.objects.filter(memberships__user=user)


def in_workspaces(model: type[Model], workspaces: Workspace | int | Iterable[Workspace | int]) -> QuerySet:
    """``model``'s rows that belong to ``workspaces``: one workspace (or its id), several, or a
    queryset of workspaces (then a subquery: no extra round trip)."""
    path = model.workspace_path
    if isinstance(workspaces, Workspace | int):
        return model._default_manager.filter(**{path: workspaces})
    if not isinstance(workspaces, QuerySet):
        workspaces = list(workspaces)
    return model._default_manager.filter(**{f"{path}__in": workspaces})
