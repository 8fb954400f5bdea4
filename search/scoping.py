"""Tenant data is read through one door: each tenant model declares the path from its rows to
their workspace (``workspace_path``), and ``in_workspaces`` derives every queryset a front door
reads from it. The REST API's views (``ApiView.scoped``), the OpenAI-compatible API and the
browser UI read tenant rows only this way (``tests/security/test_tenant_isolation.py`` checks
that no front-door module queries a tenant model directly), so a view cannot forget the filter.

``collections_chosen`` is the one check of the collections a request names (searches, answers,
uploads, listings, every door): one wording, the same whether another workspace has the ids or
nobody does, so that a refusal tells no tenant what another one holds.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from django.db.models import Model, Q, QuerySet

from ragsite.errors import DomainError
from ragsite.rows import Rows, fetch_all
from search.access import Reader
from search.models import Collection, Membership, Workspace, WorkspaceGroup


class CollectionNotFound(DomainError):
    """A request named collections that are not its workspace's (or named none)."""

    field = "collections"


def workspaces_visible_to(user) -> QuerySet:
    """The workspaces a logged-in user reads, the same in the browser UI and the REST API
    (session auth): their memberships; a superuser (the operator who set the system up) has
    them all, so that a fresh install's first administrator searches the demo corpus at once.
    An API key reads its own workspace only, whoever created it (docs/api.md)."""
    if user.is_superuser:
        return Workspace.objects.all()
    # A subquery each (not joins): a user in a workspace twice, directly and by a group, lists it once.
    direct = Membership.objects.filter(user=user).values("workspace_id")
    by_group = WorkspaceGroup.objects.filter(group__user=user).values("workspace_id")
    return Workspace.objects.filter(Q(pk__in=direct) | Q(pk__in=by_group))


def in_workspaces(
    model: type[Model], workspaces: Workspace | int | Iterable[Workspace | int], reader: Reader | None = None
) -> QuerySet:
    """``model``'s rows that belong to ``workspaces``: one workspace (or its id), several, or a
    queryset of workspaces (then a subquery: no extra round trip).

    A model whose rows say who may read them (``readers_path``: documents, chunks) is read for
    a ``reader`` (search.access), which must be given: its rows are those it may read."""
    path = model.workspace_path
    if isinstance(workspaces, Workspace | int):
        rows = model._default_manager.filter(**{path: workspaces})
    else:
        if not isinstance(workspaces, QuerySet):
            workspaces = list(workspaces)
        rows = model._default_manager.filter(**{f"{path}__in": workspaces})
    readers_path = getattr(model, "readers_path", None)
    if readers_path is None:
        return rows
    if reader is None:
        raise TypeError(f"{model.__name__} rows are read for a reader (search.access): pass reader=")
    if reader.unrestricted:
        return rows
    return rows.filter(**{f"{readers_path}__overlap": list(reader.principals)})


def collections_chosen(
    workspace: Workspace | None, collection_ids: Iterable[int | Collection] | None, *, field: str = "collections"
) -> list[Collection]:
    """The collections of ``workspace`` a request names, in id order; None names all of them.
    ``workspace`` None (the operator's shell, benchmarks): any workspace's. Collections already
    loaded (an answer's, chosen when it was asked) are taken as they are, without a query.
    Raises ``CollectionNotFound`` on ``field`` for an id that is not an integer, for an empty
    list, and for ids the workspace does not have, naming them."""
    if collection_ids is None and workspace is not None:
        return _workspace_collections(workspace)
    collections = Collection.objects.all() if workspace is None else in_workspaces(Collection, workspace)
    if collection_ids is None:
        return list(collections.order_by("pk"))
    collection_ids = list(collection_ids)
    if collection_ids and all(
        isinstance(item, Collection) and (workspace is None or item.workspace_id == workspace.pk)
        for item in collection_ids
    ):
        return sorted(set(collection_ids), key=lambda collection: collection.pk)
    ids = []
    for item in collection_ids:
        if isinstance(item, Collection):
            ids.append(item.pk)
        elif isinstance(item, int) and not isinstance(item, bool):
            ids.append(item)
        else:
            raise CollectionNotFound(f"{item!r} is not a collection id", field=field)
    if not ids:
        raise CollectionNotFound("choose at least one collection, or leave collections out to search all", field=field)
    found = list(collections.filter(pk__in=ids).order_by("pk"))
    missing = sorted(set(ids) - {collection.pk for collection in found})
    if missing:
        where = "" if workspace is None else " in this workspace"
        raise CollectionNotFound(f"No collection {', '.join(map(str, missing))}{where}.", field=field)
    return found


@functools.cache
def _workspace_collections_statement() -> tuple[Rows, str]:
    rows = Rows((Collection, "c"))
    where = f"c.{Collection._meta.get_field(Collection.workspace_path).column} = %s"
    return rows, f"SELECT {rows.columns} FROM {Collection._meta.db_table} c WHERE {where} ORDER BY c.id"  # noqa: S608


def _workspace_collections(workspace: Workspace) -> list[Collection]:
    """Every collection of the workspace, in id order: ``in_workspaces`` as one prepared
    statement (``ragsite.rows``), since every answer and search over a whole workspace asks
    it first (the ORM's compilation cost more than the round trip)."""
    rows, sql = _workspace_collections_statement()
    collections = []
    for row in fetch_all(sql, [workspace.pk]):
        [collection] = rows.instances(row)
        collection.workspace = workspace
        collections.append(collection)
    return collections
