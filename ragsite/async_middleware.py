"""Django's middleware without a thread hop per hook under ASGI: the one patch of Django here.

``MiddlewareMixin.__acall__`` runs every ``process_request`` and ``process_response`` of a
middleware through ``sync_to_async``, and Django adapts a synchronous ``process_view`` the
same way: under uvicorn each hook is a trip to a thread and back, 17 per request for the
nine middleware below. Their hooks compute headers and lazy objects and touch no database,
so ``install`` (from ``RagsiteConfig.ready``) makes them run in the event loop; where a hook
may reach the database (a session to save, messages kept in the session) it still goes to
the thread, as Django does. Django raises ``SynchronousOnlyOperation`` for database access
from the event loop, so a hook that reached it unexpectedly would fail loudly, never
silently. Under WSGI nothing changes. Why, the figures, and why not subclasses (Django's
deploy checks find its middleware by dotted path): docs/architecture.md.
"""

from __future__ import annotations

import django
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

# The Django whose hooks were read for this (requirements.txt pins it).
DJANGO_VERIFIED = (5, 2)


def _session_needs_thread(request) -> bool:
    """The response saves the session when it changed."""
    session = getattr(request, "session", None)
    return session is not None and (session.modified or settings.SESSION_SAVE_EVERY_REQUEST)


def _messages_need_thread(request) -> bool:
    """Messages a view added or read are stored by the response, in the session when they
    overflow the cookie."""
    storage = getattr(request, "_messages", None)
    return storage is not None and (storage.used or storage.added_new)


def _never(request) -> bool:
    return False


CSRF = "django.middleware.csrf.CsrfViewMiddleware"
# Each middleware whose hooks run in the event loop, and when its process_response needs the
# thread. By dotted path, as MIDDLEWARE names them; imported by ``install`` (the
# authentication and session middleware need the apps ready).
INLINE = {
    "django.middleware.security.SecurityMiddleware": _never,
    "csp.middleware.CSPMiddleware": _never,
    "django.contrib.sessions.middleware.SessionMiddleware": _session_needs_thread,  # a lazy session
    "django.middleware.locale.LocaleMiddleware": _never,  # the cookie and Accept-Language; headers
    "django.middleware.common.CommonMiddleware": _never,
    CSRF: _never,  # the token lives in a cookie (CSRF_USE_SESSIONS is checked)
    "django.contrib.auth.middleware.AuthenticationMiddleware": _never,  # request.user is lazy: read in a view's thread
    "django.contrib.messages.middleware.MessageMiddleware": _messages_need_thread,
    "django.middleware.clickjacking.XFrameOptionsMiddleware": _never,
}


def _inline_acall(response_needs_thread):
    async def __acall__(self, request):
        response = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            if response_needs_thread(request):
                response = await sync_to_async(self.process_response, thread_sensitive=True)(request, response)
            else:
                response = self.process_response(request, response)
        return response

    return __acall__


def _csrf_init(csrf_middleware):
    """Under ASGI the instance's ``process_view`` is a coroutine, which Django awaits as is."""
    init, process_view = csrf_middleware.__init__, csrf_middleware.process_view

    async def process_view_inline(self, request, callback, callback_args, callback_kwargs):
        return process_view(self, request, callback, callback_args, callback_kwargs)

    def __init__(self, get_response):
        init(self, get_response)
        if self.async_mode:
            self.process_view = process_view_inline.__get__(self)

    return __init__


_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    classes = {path: import_string(path) for path in INLINE}
    own = [path for path, middleware in classes.items() if {"__call__", "__acall__"} & set(vars(middleware))]
    if django.VERSION[:2] != DJANGO_VERIFIED or own:
        raise ImproperlyConfigured(
            f"ragsite/async_middleware.py patches Django's middleware, verified on Django "
            f"{'.'.join(map(str, DJANGO_VERIFIED))}; this is {django.get_version()} "
            f"({', '.join(own) or 'none'} with a call of its own): check it and update DJANGO_VERIFIED"
        )
    for path, middleware in classes.items():
        if path == CSRF:
            if settings.CSRF_USE_SESSIONS:
                continue  # its hooks read and write the session: left to Django's threads
            middleware.__init__ = _csrf_init(middleware)
        middleware.__acall__ = _inline_acall(INLINE[path])
    _installed = True
