"""Who is calling, with which scopes, on behalf of which workspace.

Two ways in:

- a client API key, ``Authorization: Bearer rk_...`` (``ClientKeyAuthentication``, wrapping
  ``billing.client_keys.authenticate``): bound to the key's workspace, limited to its scopes
  (``admin`` has all);
- a logged-in user's session (DRF's ``SessionAuthentication``, so unsafe methods need the CSRF
  token): a member of the workspace (``search.models.Membership``; a superuser reads every
  workspace, as in the UI: ``search.scoping.workspaces_visible_to``), with every scope. The
  workspace is ``?workspace=<slug>`` or the ``X-Workspace`` header, else the user's only one.

``access_resolve`` decides (the DRF permission ``WorkspaceAccess`` and the async event-stream
view both call it) and returns an ``Access``; views filter every queryset by its workspace,
so another workspace's ids are simply not found (404, never 403). A bearer token that is
present but bad is refused (401) even when a session exists: the client meant the key.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from django.contrib.auth.models import AnonymousUser
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions, status
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import SAFE_METHODS, BasePermission

from billing import client_keys
from billing.models import ClientKey
from frontdoors.api.errors import WWW_AUTHENTICATE, RestApiError
from search.access import Reader, may_change_documents, reader_of_key, reader_of_user, role_in
from search.answering.conversations import client_id_of
from search.models import Workspace
from search.scoping import workspaces_visible_to

Scope = ClientKey.Scope
WORKSPACE_HEADER = "X-Workspace"
WORKSPACE_SLUG_PATTERN = r"^[-a-zA-Z0-9_]{1,100}$"


@dataclass(frozen=True)
class Access:
    """The caller of one request: a key, or a member's session (``user``), and its workspace."""

    workspace: Workspace
    key: ClientKey | None = None
    user: object | None = None

    @functools.cached_property
    def reader(self) -> Reader:
        """What the caller may read (search.access): a member's session reads as its user, a
        key as the user or group it acts for (else as its workspace)."""
        return reader_of_key(self.key) if self.key is not None else reader_of_user(self.user)

    @property
    def client_id(self) -> str:
        """Who asks (``key:<id>`` or ``user:<id>``): whose canary arm applies and whose
        conversations these are (as answer_create defaults)."""
        return client_id_of(key=self.key, user=self.user)


class ClientKeyAuthentication(BaseAuthentication):
    """``Authorization: Bearer rk_...``: the key (``request.auth``); no header, no opinion (the
    session may authenticate). Scopes are checked per view by ``WorkspaceAccess``."""

    def authenticate(self, request):
        token = client_keys.bearer_token(request)
        if token is None:
            return None
        try:
            key = client_keys.client_key_authenticate(token)
        except client_keys.ClientKeyError as exc:
            raise exceptions.AuthenticationFailed(exc.message, code=exc.code) from None
        return AnonymousUser(), key

    def authenticate_header(self, request) -> str:
        return WWW_AUTHENTICATE


class ClientKeyScheme(OpenApiAuthenticationExtension):
    target_class = ClientKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "rk_<prefix>_<secret>",
            "description": "A client API key of the workspace (admin: Billing, Client keys), shown once.",
        }


def has_scope(key: ClientKey, scope: str | None) -> bool:
    return scope is None or scope in key.scopes or Scope.ADMIN in key.scopes


def access_resolve(
    *, key: ClientKey | None, user, scope: str | None, workspace_slug: str | None, changes_documents: bool = False
) -> Access:
    """The caller's ``Access``, or a DRF exception: 401 without a key or session, 403 for a
    key without ``scope``, a user in no workspace, or a viewer (or a key acting for one) that
    ``changes_documents``, 404 for a workspace the caller is not in, 400 when a member of
    several did not say which."""
    access = _access_resolve(key=key, user=user, scope=scope, workspace_slug=workspace_slug)
    acting_user = access.key.acts_for_user if access.key is not None else access.user
    if changes_documents and acting_user is not None and not may_change_documents(acting_user, access.workspace):
        role = role_in(acting_user, access.workspace) or "none"
        raise exceptions.PermissionDenied(
            f"{acting_user.get_username()}'s role in workspace '{access.workspace.slug}' is {role}: uploading, "
            "retrying and deleting documents and setting their readers need the editor or admin role.",
            code="insufficient_role",
        )
    return access


def _access_resolve(*, key: ClientKey | None, user, scope: str | None, workspace_slug: str | None) -> Access:
    if workspace_slug is not None and not re.fullmatch(WORKSPACE_SLUG_PATTERN, workspace_slug):
        raise RestApiError(status.HTTP_400_BAD_REQUEST, "invalid_request", "not a workspace slug", field="workspace")
    if key is not None:
        if not has_scope(key, scope):
            have = ", ".join(key.scopes) or "none"
            raise exceptions.PermissionDenied(
                f"The API key {key.masked} does not have the '{scope}' scope (it has: {have}).",
                code="insufficient_scope",
            )
        if workspace_slug is not None and workspace_slug != key.workspace.slug:
            raise _workspace_not_found(workspace_slug)
        return Access(workspace=key.workspace, key=key)
    if user is None or not user.is_authenticated:
        raise exceptions.NotAuthenticated(
            "No API key: send it as 'Authorization: Bearer rk_...' (create one in the admin), or log in.",
            code="missing_api_key",
        )
    workspaces = workspaces_visible_to(user).order_by("slug")
    if workspace_slug is not None:
        workspace = workspaces.filter(slug=workspace_slug).first()
        if workspace is None:
            raise _workspace_not_found(workspace_slug)
        return Access(workspace=workspace, user=user)
    first_two = list(workspaces[:2])
    if not first_two:
        raise exceptions.PermissionDenied("You are not a member of any workspace.", code="no_workspace")
    if len(first_two) > 1:
        raise RestApiError(
            status.HTTP_400_BAD_REQUEST,
            "workspace_required",
            f"You are a member of several workspaces: name one (?workspace=<slug> or the {WORKSPACE_HEADER} header).",
            field="workspace",
        )
    return Access(workspace=first_two[0], user=user)


def _workspace_not_found(slug: str) -> exceptions.NotFound:
    return exceptions.NotFound(f"No workspace '{slug}' of yours.", code="workspace_not_found")


def workspace_slug_of(request) -> str | None:
    """``?workspace=`` (a Django or DRF request), else the ``X-Workspace`` header; None when
    neither is given (an empty value is given, and refused as no slug)."""
    slug = request.GET.get("workspace")
    return slug if slug is not None else request.headers.get(WORKSPACE_HEADER)


class WorkspaceAccess(BasePermission):
    """Resolves ``request.access`` for the view's scope (``view.scope_for(method)``)."""

    def has_permission(self, request, view) -> bool:
        key = request.auth if isinstance(request.auth, ClientKey) else None
        request.access = access_resolve(
            key=key,
            user=request.user,
            scope=view.scope_for(request.method),
            workspace_slug=workspace_slug_of(request),
            changes_documents=request.method not in SAFE_METHODS and view.scope_for(request.method) == Scope.DOCUMENTS,
        )
        return True
