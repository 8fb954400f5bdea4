"""Signing in: by single sign-on through an OpenID provider, and by password where the operator
keeps it (``PASSWORD_SIGN_IN``). Design notes: docs/access.md, "Signing in".

The code flow itself (state, nonce, PKCE, the token request) is mozilla-django-oidc's; what is
ours is what it leaves to the site: the provider's endpoints read from its discovery document
when someone signs in (not when Django starts, so a provider that is down stops nobody's
password sign-in), an ID token held to its issuer, audience and expiry (the library checks
only the signature and the nonce), users found by the provider's stable subject and never by
e-mail (an address can change hands), and the provider's groups claim made group memberships.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlencode

import jwt
import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.models import Group
from django.core.exceptions import SuspiciousOperation
from django.db import IntegrityError, transaction
from django.utils import timezone
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from ragsite.models import Identity, ProvidedGroup

logger = logging.getLogger(__name__)

# How long a provider's discovery document is trusted before it is read again (keys rotate
# through jwks_uri, which is read at every sign-in; the endpoints themselves rarely move).
DISCOVERY_MAX_AGE_S = 3600
_REQUIRED_ENDPOINTS = ("issuer", "authorization_endpoint", "token_endpoint", "jwks_uri")
GROUP_NAME_MAX_CHARS = 150  # django.contrib.auth.models.Group.name


class ProviderUnavailable(Exception):
    """The identity provider could not be reached, or answered with something unusable."""


class SignInRefused(Exception):
    """The provider answered, and what it said does not sign anyone in: the reason, for the
    operator (the audit log and the logs); the person is told less."""


def sso_enabled() -> bool:
    return bool(settings.OIDC_DISCOVERY_URL)


_discovery_lock = threading.Lock()
_discovery: dict = {}  # "document", "read_at"


def provider_configuration() -> dict:
    """The provider's discovery document (OpenID Connect Discovery 1.0), read again after
    ``DISCOVERY_MAX_AGE_S``. Raises ``ProviderUnavailable`` naming what went wrong."""
    with _discovery_lock:
        document, read_at = _discovery.get("document"), _discovery.get("read_at", 0.0)
        if document is not None and time.monotonic() - read_at < DISCOVERY_MAX_AGE_S:
            return document
    url = settings.OIDC_DISCOVERY_URL
    try:
        response = requests.get(url, timeout=settings.OIDC_TIMEOUT)
        response.raise_for_status()
        document = response.json()
    except requests.RequestException as error:
        raise ProviderUnavailable(
            f"the identity provider's discovery document ({url}) could not be read: {error}"
        ) from error
    except ValueError as error:
        raise ProviderUnavailable(f"the identity provider's discovery document ({url}) is not JSON") from error
    missing = [name for name in _REQUIRED_ENDPOINTS if not isinstance(document.get(name), str)]
    if missing:
        raise ProviderUnavailable(f"the identity provider's discovery document ({url}) lacks {', '.join(missing)}")
    with _discovery_lock:
        _discovery.update(document=document, read_at=time.monotonic())
    return document


def discovery_forget() -> None:
    """Read the discovery document again at the next sign-in (tests; a provider that moved)."""
    with _discovery_lock:
        _discovery.clear()


class PasswordBackend(ModelBackend):
    """Django's password sign-in, as far as ``PASSWORD_SIGN_IN`` allows: ``on``, ``superusers``
    (a way in for the administrators while the provider is down) or ``off``."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if settings.PASSWORD_SIGN_IN == "off":  # noqa: S105 - a mode, not a password
            return None
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is not None and settings.PASSWORD_SIGN_IN == "superusers" and not user.is_superuser:  # noqa: S105
            return None
        return user


class OpenIDBackend(OIDCAuthenticationBackend):
    """mozilla-django-oidc's backend, with endpoints from discovery and the checks it leaves out."""

    def __init__(self, *args, **kwargs):
        # Django builds every backend for every sign-in, passwords included: nothing here may
        # reach the provider. Its endpoints are read in ``authenticate``, for a code flow only.
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None
        self.UserModel = get_user_model()

    def authenticate(self, request, **kwargs):
        if request is None or "nonce" not in kwargs or not request.GET.get("code") or not request.GET.get("state"):
            return None  # a password sign-in, or a callback without a code
        configuration = provider_configuration()
        self.issuer = configuration["issuer"]
        self.OIDC_OP_TOKEN_ENDPOINT = configuration["token_endpoint"]
        self.OIDC_OP_USER_ENDPOINT = configuration.get("userinfo_endpoint")
        self.OIDC_OP_JWKS_ENDPOINT = configuration["jwks_uri"]
        return super().authenticate(request, **kwargs)

    def get_user(self, user_id):
        """The session's user, while active: a user deactivated here (or by the provider's
        provisioning) is signed out at their next request, as Django's own backend does."""
        user = super().get_user(user_id)
        return user if user is not None and user.is_active else None

    def get_token(self, payload):
        try:
            return super().get_token(payload)
        except requests.HTTPError as error:
            # The provider's own words (invalid_grant for a code used twice or expired), not the secret.
            raise SignInRefused(f"the provider refused the authorization code: {error.response.text[:300]}") from error

    def retrieve_matching_jwk(self, token):
        try:
            return super().retrieve_matching_jwk(token)
        except SuspiciousOperation as error:
            raise SignInRefused("the ID token is signed by a key the provider does not publish (its kid)") from error
        except (jwt.InvalidTokenError, KeyError) as error:
            raise SignInRefused("the ID token's header cannot be read") from error

    def _verify_jws(self, payload, key):
        """The ID token's signature, and its issuer, audience, authorized party and times
        (OpenID Connect Core 3.1.3.7), each refusal with its reason."""
        try:
            algorithm = jwt.get_unverified_header(payload).get("alg")
        except jwt.InvalidTokenError as error:
            raise SignInRefused("the ID token is not a JSON web token") from error
        if algorithm != self.OIDC_RP_SIGN_ALGO:
            raise SignInRefused(f"the ID token is signed with {algorithm}, not {self.OIDC_RP_SIGN_ALGO}")
        try:
            claims = jwt.decode(
                payload,
                key,
                algorithms=[algorithm],
                audience=self.OIDC_RP_CLIENT_ID,
                issuer=self.issuer,
                leeway=settings.OIDC_CLOCK_SKEW_S,
                options={"require": ["iss", "aud", "sub", "exp", "iat"]},
            )
        except jwt.InvalidSignatureError as error:
            raise SignInRefused("the ID token's signature does not verify with the provider's published key") from error
        except jwt.ExpiredSignatureError as error:
            raise SignInRefused("the ID token has expired") from error
        except jwt.InvalidAudienceError as error:
            raise SignInRefused(
                "the ID token was issued for another client (its audience is not our client id)"
            ) from error
        except jwt.InvalidIssuerError as error:
            raise SignInRefused(f"the ID token was issued by another issuer than {self.issuer}") from error
        except jwt.InvalidTokenError as error:
            raise SignInRefused(f"the ID token is not valid: {error}") from error
        audiences = claims["aud"] if isinstance(claims["aud"], list) else [claims["aud"]]
        if len(audiences) > 1 and claims.get("azp") != self.OIDC_RP_CLIENT_ID:
            raise SignInRefused("the ID token names several audiences and another authorized party")
        return claims

    def verify_token(self, token, **kwargs):
        try:
            return super().verify_token(token, **kwargs)
        except SuspiciousOperation as error:  # the nonce: a token minted for another sign-in
            raise SignInRefused(f"the ID token does not belong to this sign-in ({error})") from error

    def get_or_create_user(self, access_token, id_token, payload):
        claims = dict(payload)
        if self.OIDC_OP_USER_ENDPOINT:
            try:
                userinfo = self.get_userinfo(access_token, id_token, payload)
            except requests.RequestException as error:
                raise ProviderUnavailable(f"the identity provider's userinfo endpoint failed: {error}") from error
            if userinfo.get("sub") != payload["sub"]:  # OpenID Connect Core 5.3.2
                raise SignInRefused("the provider's userinfo names another subject than its ID token")
            claims.update(userinfo)
        return identity_sign_in(issuer=self.issuer, claims=claims)


def identity_sign_in(*, issuer: str, claims: dict):
    """The user of the provider's subject, made on their first sign-in; their e-mail and name
    as the provider says now, and their provided groups those of the groups claim."""
    subject = str(claims["sub"])
    groups = _group_names(claims)
    User = get_user_model()
    with transaction.atomic():
        identity = (
            Identity.objects.select_related("user").select_for_update().filter(issuer=issuer, subject=subject).first()
        )
        if identity is None:
            identity = _identity_create(issuer, subject, claims)
        user = identity.user
        changed = {
            "email": str(claims.get("email") or "")[: User._meta.get_field("email").max_length],
            "first_name": str(claims.get("given_name") or "")[:150],
            "last_name": str(claims.get("family_name") or "")[:150],
        }
        if not changed["first_name"] and not changed["last_name"] and claims.get("name"):
            changed["first_name"] = str(claims["name"])[:150]
        if any(getattr(user, name) != value for name, value in changed.items()):
            for name, value in changed.items():
                setattr(user, name, value)
            user.save(update_fields=list(changed))
        identity.signed_in_at = timezone.now()
        identity.save(update_fields=["signed_in_at"])
        provided_groups_set(user, issuer, groups)
    return user


def _identity_create(issuer: str, subject: str, claims: dict):
    User = get_user_model()
    for _ in range(3):
        try:
            with transaction.atomic():
                user = User(username=_free_username(claims))
                user.set_unusable_password()  # signs in through the provider only
                user.save()
                return Identity.objects.create(user=user, issuer=issuer, subject=subject)
        except IntegrityError:
            # The same person's first sign-in in another tab won the race (theirs is the user),
            # or another person's took the username a moment ago (another name is tried).
            won = Identity.objects.select_related("user").select_for_update().filter(issuer=issuer, subject=subject)
            if won.exists():
                return won.get()
    raise SignInRefused(f"no user could be made for subject {subject!r}: its usernames kept being taken")


def _free_username(claims: dict) -> str:
    """The provider's preferred_username (else the e-mail's local part), with -2, -3... when a
    user already has it: a username is shown and names readers, it identifies no one."""
    User = get_user_model()
    wanted = str(claims.get("preferred_username") or str(claims.get("email") or "").partition("@")[0] or "user")
    wanted = "".join(ch for ch in wanted if ch.isprintable() and not ch.isspace())[:140] or "user"
    name, number = wanted, 1
    while User.objects.filter(username=name).exists():
        number += 1
        name = f"{wanted}-{number}"
    return name


def _group_names(claims: dict) -> set[str]:
    """The groups claim as a set of names; absent means none. Refuses a claim that is not a
    list of names, rather than guess at whom it grants what."""
    value = claims.get(settings.OIDC_GROUPS_CLAIM)
    if value is None:
        return set()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise SignInRefused(f"the {settings.OIDC_GROUPS_CLAIM!r} claim is not a list of group names")
    names = {name.strip() for name in value if name.strip()}
    too_long = sorted(name for name in names if len(name) > GROUP_NAME_MAX_CHARS or "\x00" in name)
    if too_long:
        raise SignInRefused(
            f"a group name in the {settings.OIDC_GROUPS_CLAIM!r} claim cannot be kept: {too_long[0][:80]!r}"
        )
    return names


def provided_groups_set(user, issuer: str, names: set[str]) -> None:
    """``user``'s memberships of provided groups become exactly ``names`` (made, and marked as
    provided, when new); memberships of groups made by hand stay."""
    wanted = []
    for name in sorted(names):
        group, _ = Group.objects.get_or_create(name=name)
        ProvidedGroup.objects.get_or_create(group=group, defaults={"issuer": issuer})
        wanted.append(group)
    current = set(user.groups.filter(provided__isnull=False))
    user.groups.remove(*(current - set(wanted)))
    user.groups.add(*(set(wanted) - current))


def provider_sign_out_url(request, id_token: str | None, return_to: str) -> str | None:
    """Where to send a person signing out so the provider ends its session too (RP-initiated
    logout 1.0), or None when it has no end_session_endpoint or cannot be reached."""
    if not sso_enabled() or not id_token:
        return None
    try:
        endpoint = provider_configuration().get("end_session_endpoint")
    except ProviderUnavailable as error:
        logger.warning("signed out here only: %s", error)
        return None
    if not endpoint:
        return None
    query = urlencode(
        {"id_token_hint": id_token, "post_logout_redirect_uri": return_to, "client_id": settings.OIDC_RP_CLIENT_ID}
    )
    return f"{endpoint}{'&' if '?' in endpoint else '?'}{query}"
