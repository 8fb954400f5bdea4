"""Who may read a document: its readers, and the reader a request reads as.

A document is either open to everyone its workspace admits (``Document.readers == ["*"]``)
or restricted to users and groups (``"u:<id>"``, ``"g:<id>"``). Every chunk carries its
document's readers, so that rankings filter on them inside the ranking SQL, in the same
scan that finds the nearest vectors (search.selectors). A request reads as a ``Reader``:
the principals it holds (``*`` always, its user, its user's groups), and a search or a
listing keeps only rows whose readers overlap them. Design notes: docs/access.md.

Ids are never reused (PostgreSQL sequences), so a deleted user's or group's principal left
on a document names nobody: it grants nothing.

What a member may do besides reading is their role in the workspace (``role_in``: viewer,
editor, admin), given to them or to a group of theirs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db.models import Q

from ragsite.errors import DomainError
from search.models import Document, Membership, Role, Workspace, WorkspaceGroup

EVERYONE = "*"  # every reader of the document's workspace
# A restricted document, in SQL: the predicate of the partial index that holds them
# (search migration 0013), written the same way wherever it must be used.
RESTRICTED_SQL = "NOT (readers @> '{*}'::varchar[])"
_USER, _GROUP = "u:", "g:"


class AccessError(DomainError):
    """Readers that cannot be set as asked (a user or group that does not exist...)."""

    field = "readers"


def user_principal(user_id: int) -> str:
    return f"{_USER}{int(user_id)}"


def group_principal(group_id: int) -> str:
    return f"{_GROUP}{int(group_id)}"


@dataclass(frozen=True)
class Reader:
    """What one request may read. ``principals`` None reads every document: the operator's
    own tools (management commands, benchmarks), never a front door."""

    principals: tuple[str, ...] | None

    @property
    def unrestricted(self) -> bool:
        return self.principals is None

    def may_read(self, readers: Iterable[str]) -> bool:
        return self.principals is None or bool(set(readers) & set(self.principals))


# Documents open to their whole workspace only: what a caller that names no user reads (a
# workspace-wide API key), and what a service reads when no reader is passed to it.
WORKSPACE = Reader(principals=(EVERYONE,))
# Every document, restricted or not: management commands and benchmarks.
OPERATOR = Reader(principals=None)


def reader_of_user(user) -> Reader:
    """A signed-in user's reader: the open documents, those naming them, and those naming
    a group they belong to (read now: a change of groups holds on the next request)."""
    if user is None or not getattr(user, "is_authenticated", False):
        return WORKSPACE
    groups = user.groups.values_list("pk", flat=True)
    return Reader(principals=(EVERYONE, user_principal(user.pk), *(group_principal(pk) for pk in sorted(groups))))


def reader_of_key(key) -> Reader:
    """A client key's reader (``billing.models.ClientKey``): its user's while that user is a
    member of the key's workspace, its group's, or else the workspace's open documents."""
    user = key.acts_for_user
    if user is not None:
        if role_in(user, key.workspace_id) is not None:
            return reader_of_user(user)
        return WORKSPACE
    if key.acts_for_group_id is not None:
        return Reader(principals=(EVERYONE, group_principal(key.acts_for_group_id)))
    return WORKSPACE


_ROLE_RANK = {Role.VIEWER: 0, Role.EDITOR: 1, Role.ADMIN: 2}


def role_in(user, workspace: Workspace | int) -> str | None:
    """``user``'s role in ``workspace``: the highest of their membership's and their groups'
    (``WorkspaceGroup``), admin for a superuser, None for someone who is not in it."""
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return None
    if user.is_superuser:
        return Role.ADMIN
    roles = [
        *Membership.objects.filter(workspace=workspace, user=user).values_list("role", flat=True),
        *WorkspaceGroup.objects.filter(workspace=workspace, group__user=user).values_list("role", flat=True),
    ]
    return max(roles, key=_ROLE_RANK.__getitem__, default=None)


def may_change_documents(user, workspace: Workspace | int) -> bool:
    """Upload, retry and delete documents and set their readers: editors and admins."""
    role = role_in(user, workspace)
    return role is not None and _ROLE_RANK[role] >= _ROLE_RANK[Role.EDITOR]


def readers_for(
    *, users: Iterable[int | str] = (), groups: Iterable[int | str] = (), workspace: Workspace | int | None = None
) -> list[str]:
    """A document's readers: open to its workspace when no user or group is named, else
    exactly the named ones, each by id or by name (a username, a group's name). Raises
    ``AccessError`` naming every one that does not exist. With ``workspace`` (the front doors),
    only its people and groups (``workspace_people``, ``workspace_groups``) exist: another
    tenant's user or group is missing in the same words as one nobody made, so a refusal does
    not tell whether a name is taken elsewhere."""
    User = get_user_model()
    people = User.objects.all() if workspace is None else workspace_people(workspace)
    named_groups = Group.objects.all() if workspace is None else workspace_groups(workspace)
    user_ids, missing = _ids(people, User.USERNAME_FIELD, users, "user")
    group_ids, missing_groups = _ids(named_groups, "name", groups, "group")
    if missing or missing_groups:
        raise AccessError(f"no such {', '.join(missing + missing_groups)}: a document's readers must exist")
    if not user_ids and not group_ids:
        return [EVERYONE]
    return [user_principal(pk) for pk in user_ids] + [group_principal(pk) for pk in group_ids]


def workspace_people(workspace: Workspace | int):
    """The users in ``workspace``: its members, directly or by a group."""
    direct = Membership.objects.filter(workspace=workspace).values("user_id")
    by_group = WorkspaceGroup.objects.filter(workspace=workspace).values("group_id")
    return get_user_model().objects.filter(Q(pk__in=direct) | Q(groups__in=by_group)).distinct()


def workspace_groups(workspace: Workspace | int):
    """The groups a document of ``workspace`` may be restricted to: its members' groups and the
    groups given the workspace."""
    members = Membership.objects.filter(workspace=workspace).values("user_id")
    granted = WorkspaceGroup.objects.filter(workspace=workspace).values("group_id")
    return Group.objects.filter(Q(user__in=members) | Q(pk__in=granted)).distinct()


def _ids(rows, name_field: str, named: Iterable[int | str], kind: str) -> tuple[list[int], list[str]]:
    """The ids of ``rows`` named by id or by ``name_field``, and the names of those missing."""
    named = list(named)
    for item in named:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise AccessError(f"a {kind} is named by its id or its name, not {json.dumps(item)[:100]}")
        if isinstance(item, int) and not 0 < item < 2**63:
            raise AccessError(f"no such {kind} {item}: a document's readers must exist")
    wanted_ids = {item for item in named if isinstance(item, int)}
    wanted_names = {item for item in named if isinstance(item, str)}
    found = dict(rows.filter(pk__in=wanted_ids).values_list("pk", name_field))
    # A name PostgreSQL cannot hold (a NUL character) names nobody: not looked up, reported missing.
    storable = {name for name in wanted_names if "\x00" not in name}
    by_name = dict(rows.filter(**{f"{name_field}__in": storable}).values_list(name_field, "pk"))
    missing = [f"{kind} {pk}" for pk in sorted(wanted_ids - set(found))]
    missing += [f"{kind} {name!r}" for name in sorted(wanted_names - set(by_name))]
    return sorted(set(found) | set(by_name.values())), missing


def readers_listed(readers: Iterable[str]) -> dict:
    """A document's readers as ``{"everyone": bool, "users": [ids], "groups": [ids]}``. A
    deleted user's or group's id may still be listed: it names nobody, and grants nothing."""
    readers = list(readers)
    return {
        "everyone": EVERYONE in readers,
        "users": sorted(int(r[len(_USER) :]) for r in readers if r.startswith(_USER)),
        "groups": sorted(int(r[len(_GROUP) :]) for r in readers if r.startswith(_GROUP)),
    }


def documents_unreadable(document_ids: Iterable[int], reader: Reader) -> set[int]:
    """Which of these documents ``reader`` may not read now (a deleted one included)."""
    document_ids = set(document_ids)
    if reader.unrestricted or not document_ids:
        return set()
    readable = Document.objects.filter(pk__in=document_ids, readers__overlap=list(reader.principals))
    return document_ids - set(readable.values_list("pk", flat=True))


def answer_readable(answer, reader: Reader) -> bool:
    """Whether ``reader`` may read every document ``answer``'s sources came from."""
    return not documents_unreadable({source["document_id"] for source in answer.sources or ()}, reader)
