"""The sign-in page, single sign-on's two legs (to the provider, and back), and signing out.

Single sign-on is mozilla-django-oidc's code flow with ragsite.identity's backend; these views
add what a person and an operator see when it fails: the page says what to do, the audit log
and the logs say why (docs/access.md, "Signing in").
"""

from __future__ import annotations

import logging

import requests
from django.conf import settings
from django.contrib import auth
from django.contrib.auth import views as auth_views
from django.core.exceptions import SuspiciousOperation
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import render, resolve_url
from django.utils.translation import gettext as _
from django.views.decorators.http import require_POST
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from ragsite.audit import Action, audit_record
from ragsite.identity import (
    ProviderUnavailable,
    SignInRefused,
    provider_configuration,
    provider_sign_out_url,
    sso_enabled,
)

logger = logging.getLogger(__name__)


def _provider_name() -> str:
    return settings.OIDC_PROVIDER_NAME or _("single sign-on")


def _sign_in_context(request) -> dict:
    return {
        "sso": sso_enabled(),
        "provider_name": _provider_name(),
        "password_sign_in": settings.PASSWORD_SIGN_IN,
    }


def _sign_in_failed(request, *, reason: str, message: str, status: int):
    """The sign-in page with ``message`` for the person, and ``reason`` for the operator."""
    logger.warning("single sign-on refused: %s", reason)
    audit_record(Action.SIGN_IN_FAILED, request=request, outcome="refused", detail={"method": "oidc", "reason": reason})
    context = {**_sign_in_context(request), "form": None, "sign_in_error": message, "next": ""}
    return render(request, "registration/login.html", context, status=status)


class SignInView(auth_views.LoginView):
    """Django's sign-in page, with the single sign-on button and passwords as configured."""

    def get_context_data(self, **kwargs):
        return {**super().get_context_data(**kwargs), **_sign_in_context(self.request)}

    def post(self, request, *args, **kwargs):
        if settings.PASSWORD_SIGN_IN == "off":  # noqa: S105 - a mode, not a password
            context = {
                **self.get_context_data(),
                "sign_in_error": _("Password sign-in is turned off here: sign in with %(provider)s.")
                % {"provider": _provider_name()},
            }
            return self.render_to_response(context, status=403)
        return super().post(request, *args, **kwargs)


class OpenIDStartView(OIDCAuthenticationRequestView):
    """To the provider: state, nonce and PKCE kept in the session, its authorization endpoint
    read from discovery now."""

    def __init__(self, **kwargs):
        super(OIDCAuthenticationRequestView, self).__init__(**kwargs)  # no endpoint from settings
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID

    def get(self, request):
        if not sso_enabled():
            raise Http404("single sign-on is not set up (OIDC_DISCOVERY_URL)")
        try:
            self.OIDC_OP_AUTH_ENDPOINT = provider_configuration()["authorization_endpoint"]
        except ProviderUnavailable as error:
            return _sign_in_failed(request, reason=str(error), message=_unreachable(), status=503)
        return super().get(request)


class OpenIDCallbackView(OIDCAuthenticationCallbackView):
    """Back from the provider: the code exchanged, the ID token checked, the user signed in."""

    def get(self, request):
        if not sso_enabled():
            raise Http404("single sign-on is not set up (OIDC_DISCOVERY_URL)")
        try:
            return super().get(request)
        except ProviderUnavailable as error:
            return _sign_in_failed(request, reason=str(error), message=_unreachable(), status=503)
        except requests.RequestException as error:
            reason = f"the identity provider could not be reached: {error}"
            return _sign_in_failed(request, reason=reason, message=_unreachable(), status=503)
        except SignInRefused as error:
            message = _(
                "The identity provider's answer could not be accepted, so you were not signed in. "
                "Your administrator can see why in the audit log."
            )
            return _sign_in_failed(request, reason=str(error), message=message, status=400)
        except SuspiciousOperation as error:  # mozilla-django-oidc: a state this browser never started, or used
            reason = f"the callback's state is not one this browser is waiting for (replayed or expired): {error}"
            return _sign_in_failed(request, reason=reason, message=_started_again(), status=400)

    def login_success(self):
        response = super().login_success()
        self.request.session.set_expiry(settings.OIDC_SESSION_MAX_AGE_S)
        return response

    def login_failure(self):
        request = self.request
        if request.GET.get("error"):
            said = f"{request.GET['error']}: {request.GET.get('error_description', '')}".strip(": ")
            reason = f"the identity provider did not sign the user in ({said[:300]})"
            return _sign_in_failed(
                request, reason=reason, message=_("The identity provider did not sign you in."), status=403
            )
        user = getattr(self, "user", None)
        if user is not None and not user.is_active:
            reason = f"user {user.pk} ({user.get_username()}) is deactivated"
            return _sign_in_failed(request, reason=reason, message=_("Your account here is deactivated."), status=403)
        reason = "the callback came without a sign-in started in this browser (no state in its session)"
        return _sign_in_failed(request, reason=reason, message=_started_again(), status=400)


def _unreachable() -> str:
    return _("The identity provider could not be reached. Try again in a few minutes, or ask your administrator.")


def _started_again() -> str:
    return _("This sign-in link has been used already or has expired: sign in again.")


def admin_sign_in(request, extra_context=None):
    """The admin's own sign-in page (``AdminSite.login``), sent to the site's."""
    query = f"?{request.GET.urlencode()}" if request.GET else ""
    return HttpResponseRedirect(f"{resolve_url(settings.LOGIN_URL)}{query}")


@require_POST
def sign_out(request):
    """Signs out here, then at the provider too when it offers that (its end_session_endpoint)."""
    id_token = request.session.get("oidc_id_token")
    auth.logout(request)
    sign_in_page = resolve_url(settings.LOGIN_URL)
    at_provider = provider_sign_out_url(request, id_token, request.build_absolute_uri(sign_in_page))
    return HttpResponseRedirect(at_provider or sign_in_page)
