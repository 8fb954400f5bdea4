"""The browser UI's languages: Japanese and English (``settings.LANGUAGES``; docs/ui.md "Languages").

Django's ``LocaleMiddleware`` picks each request's language from the language cookie, else
Accept-Language, else ``LANGUAGE_CODE``. The header's switcher (``language_choose``, through
Django's ``set_language``) sets that cookie, and for a signed-in user also saves the choice
on the account (``ragsite.models.UserPreference``). Every page behind ``member_required``
applies the saved choice (``language_apply``: it wins over the cookie, so it follows the user
into a new session or another browser) and puts it in the cookie (``language_remember``), so
that the pages outside the UI's views (the login page after logging out, the admin) speak it
too. The account is read once per session, not once per request, and in the view's own
thread: a middleware reading it would cost each request a trip to a thread under ASGI.

The domain (``search/``) words its refusals in English for every client, the APIs included;
``domain_text`` shows those the UI meets most in the page's language (``DOMAIN_TEXTS``).
``script_strings`` are ui.js's words, passed in the page as JSON.
"""

from __future__ import annotations

from inspect import iscoroutinefunction

from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.utils import translation
from django.utils.translation import gettext, gettext_noop, ngettext
from django.views.decorators.http import require_POST
from django.views.i18n import set_language

from ragsite.models import UserPreference

# The user's saved language in the session: "" for none saved (the browser's applies).
SESSION_KEY = "ui_language"
# The doors whose answers programs read (frontdoors/urls.py): their JSON and messages are
# the same whatever language the client's Accept-Language names.
MACHINE_DOORS = ("/api/", "/v1/")

# Refusals and reasons of the domain, exactly as search/ words them, that the UI translates
# (gettext_noop marks them for the catalogue; ``domain_text`` looks them up). One the
# catalogue lacks is shown as the domain wrote it.
DOMAIN_TEXTS = (
    gettext_noop("the question is empty"),
    gettext_noop("the query is empty"),
    gettext_noop("the file is empty"),
    gettext_noop("no text found in the document"),
    gettext_noop("the PDF is encrypted with a password"),
    gettext_noop("these collections use different embedding models; search them separately"),
    gettext_noop("these collections use different text-search languages; search them separately"),
    gettext_noop("no generation model is configured"),
    gettext_noop("the generation model is still starting"),
    gettext_noop("nothing in the model's answer was supported by its sources"),
    gettext_noop("the same file is already in this collection, restricted to others"),
)


def is_supported(language: str) -> bool:
    return language in dict(settings.LANGUAGES)


def _activate(request, language: str) -> None:
    translation.activate(language)
    request.LANGUAGE_CODE = language


def language_apply(request) -> None:
    """Before a UI view: the signed-in user's saved language over the browser's."""
    if SESSION_KEY not in request.session:  # a new session: the account is read once
        saved = UserPreference.objects.filter(user=request.user).values_list("language", flat=True).first()
        request.session[SESSION_KEY] = saved if saved and is_supported(saved) else ""
    if request.session[SESSION_KEY]:
        _activate(request, request.session[SESSION_KEY])


def language_remember(request, response):
    """After a UI view: the saved language in the cookie when the browser did not send it,
    for the pages that do not look at the account (the login page after logging out)."""
    language = request.session.get(SESSION_KEY, "")
    if language and request.COOKIES.get(settings.LANGUAGE_COOKIE_NAME) != language:
        language_cookie_set(response, language)
    return response


def language_cookie_set(response, language: str) -> None:
    """The cookie as Django's ``set_language`` sets it (its settings, its lifetime)."""
    response.set_cookie(
        settings.LANGUAGE_COOKIE_NAME,
        language,
        max_age=settings.LANGUAGE_COOKIE_AGE,
        path=settings.LANGUAGE_COOKIE_PATH,
        domain=settings.LANGUAGE_COOKIE_DOMAIN,
        secure=settings.LANGUAGE_COOKIE_SECURE,
        httponly=settings.LANGUAGE_COOKIE_HTTPONLY,
        samesite=settings.LANGUAGE_COOKIE_SAMESITE,
    )


@require_POST
def language_choose(request):
    """The header's switcher: Django's ``set_language`` (the cookie, the redirect back to
    ``next``), and for a signed-in user the choice saved on the account and in the session,
    so that a later login, in this browser or another, finds it."""
    language = request.POST.get("language", "")
    response = set_language(request)
    if not is_supported(language):
        # set_language takes any language Django has a catalogue for; the site speaks two.
        response.cookies.pop(settings.LANGUAGE_COOKIE_NAME, None)
        return response
    if request.user.is_authenticated:
        UserPreference.objects.update_or_create(user=request.user, defaults={"language": language})
        request.session[SESSION_KEY] = language
    return response


def domain_text(message: str, names=()) -> str:
    """A refusal or reason of the domain in the active language where the catalogue has it
    (``DOMAIN_TEXTS``), else as the domain wrote it. An upload's refusal starts with the file's
    name (``"notes.pdf: the PDF is encrypted with a password"``): ``names`` are the names it
    may start with, kept as they are."""
    for name in names:
        prefix = f"{name}: "
        if message.startswith(prefix):
            return prefix + domain_text(message[len(prefix) :])
    # gettext("") is the catalogue's header, not a translation.
    return gettext(message) if message else message


def script_strings() -> dict[str, str]:
    """What static/search/ui.js writes into the page, in the active language. ``%(name)s``
    is filled in by the script. Plurals: the one and the other form (all that English and
    Japanese have; Japanese has one form, so both are the same)."""
    unsupported_one, unsupported_other = (
        ngettext(
            "%(counter)s sentence not supported by the passages given (marked).",
            "%(counter)s sentences not supported by the passages given (marked).",
            count,
        )
        for count in (1, 2)
    )
    return {
        "source": gettext("Source %(number)s: %(title)s"),
        "unsupported_title": gettext("No passage given to the answer supports this sentence"),
        "writing": gettext("Writing the answer…"),
        "reading": gettext("Reading the sources: %(done)s of %(total)s parts done…"),
        "retrying": gettext("The model did not answer (%(kind)s); trying again…"),
        "retrying_unknown": gettext("The model did not answer; trying again…"),
        "checking": gettext("Checking the citations…"),
        "done": gettext("Done."),
        "unsupported_one": unsupported_one,
        "unsupported_other": unsupported_other,
        "failed": gettext("Failed: %(reason)s"),
        "refused": gettext("The connection was refused. Reload the page to see the answer."),
        "reconnecting": gettext("Connection lost; reconnecting…"),
        "stopped": gettext("Stopped."),
        "chosen": gettext("Chosen: %(names)s"),
        "server_failed": gettext("The server could not do that (HTTP %(status)s). Try again, or reload the page."),
        "unreachable": gettext("The server could not be reached. Try again."),
    }


class MachineDoorsInEnglishMiddleware:
    """After ``LocaleMiddleware``: the API doors (``MACHINE_DOORS``) in ``LANGUAGE_CODE``
    whatever the request's Accept-Language or cookie, so that the messages in their JSON
    (DRF's own among them, which Django would translate) never change with the client's
    language. It runs in the event loop under ASGI (no thread hop, like the middleware of
    ragsite/async_middleware.py): it reads the path only."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    @staticmethod
    def _pin(request) -> None:
        if request.path_info.startswith(MACHINE_DOORS):
            _activate(request, settings.LANGUAGE_CODE)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        self._pin(request)
        return self.get_response(request)

    async def __acall__(self, request):
        self._pin(request)
        return await self.get_response(request)
