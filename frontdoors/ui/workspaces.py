"""Who may see what in the browser UI: a login, and membership of the object's workspace.

Lists (search, documents, recent questions) show the workspace chosen in the session
among the user's memberships; a single object (an answer, a passage, a document) is
found only within the user's workspaces, so anything else is a 404, never a 403 that
would confirm it exists.
"""

from __future__ import annotations

from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.shortcuts import render
from django.utils.functional import SimpleLazyObject
from django_htmx.http import HttpResponseClientRedirect

from frontdoors.ui.languages import language_apply, language_remember
from search.access import reader_of_user
from search.models import Workspace
from search.scoping import workspaces_visible_to

SESSION_KEY = "ui_workspace_id"


def user_workspaces(user) -> list[Workspace]:
    """The user's workspaces (``search.scoping.workspaces_visible_to``: the API's rule too)."""
    return list(workspaces_visible_to(user).order_by("name", "pk"))


def workspace_choose(request, workspace: Workspace) -> None:
    request.session[SESSION_KEY] = workspace.pk


def member_required(view):
    """Log in first, then set ``request.workspaces`` (the user's) and ``request.workspace``
    (the session's choice, else the first) and ``request.reader``; a user without any membership is told so. The
    page speaks the user's saved language, if any (``frontdoors.ui.languages``)."""

    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_authenticated:
            if request.htmx:
                # A fragment request from a page whose session has ended: reload the whole
                # page as the login form rather than swapping the form into a fragment.
                page = request.htmx.current_url_abs_path or request.get_full_path()
                return HttpResponseClientRedirect(redirect_to_login(page)["Location"])
            return redirect_to_login(request.get_full_path())
        language_apply(request)
        workspaces = user_workspaces(request.user)
        if not workspaces:
            return language_remember(request, render(request, "search/no_workspace.html", status=403))
        chosen = request.session.get(SESSION_KEY)
        current = next((workspace for workspace in workspaces if workspace.pk == chosen), workspaces[0])
        if current.pk != chosen:
            workspace_choose(request, current)
        request.workspaces = workspaces
        request.workspace = current
        # What this user may read (search.access), read on the first use: most pages need none.
        request.reader = SimpleLazyObject(lambda: reader_of_user(request.user))
        return language_remember(request, view(request, *args, **kwargs))

    return wrapper
