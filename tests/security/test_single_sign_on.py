"""Single sign-on by OpenID Connect against a real provider: django-oauth-toolkit's, in a
Django project of its own run as its own process (tests/identity_provider/), reached over
HTTP by the site's real code flow (mozilla-django-oidc and ragsite.identity). The provider's
sign-in form is filled over HTTP here; tests/frontdoors/ui/test_browser_sso.py does it in a
browser. Bad ID tokens come from the provider itself, told by its control door to issue them.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urljoin, urlsplit

import pytest
import requests
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client

from ragsite.audit import Action
from ragsite.identity import discovery_forget
from ragsite.models import AuditEvent, Identity, ProvidedGroup
from tests.identity_provider.process import IdentityProvider

pytestmark = pytest.mark.django_db

CLIENT_ID, CLIENT_SECRET = "rag-search", "secret-of-the-relying-party-0123456789"
SITE = "http://testserver"  # where Django's test client is: the redirect URI the provider knows


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    identity_provider = IdentityProvider(tmp_path_factory.mktemp("provider"))
    identity_provider.start()
    identity_provider.client_set(CLIENT_ID, CLIENT_SECRET, SITE)
    yield identity_provider
    identity_provider.stop()


@pytest.fixture
def sso(provider, settings):
    """The site set up as the README says: discovery URL, client id and secret."""
    settings.OIDC_DISCOVERY_URL = provider.discovery_url
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.AUTHENTICATION_BACKENDS = ["ragsite.identity.PasswordBackend", "ragsite.identity.OpenIDBackend"]
    discovery_forget()
    provider.faults_set()
    yield provider
    provider.faults_set()
    discovery_forget()


def code_from_provider(client: Client, provider: IdentityProvider, username: str, *, next_url: str = "") -> str:
    """Start at the site, sign in at the provider as ``username``; the site's callback URL
    (path and query) the provider sends the browser back to, not yet followed."""
    start = client.get("/accounts/oidc/start/", {"next": next_url} if next_url else {})
    assert start.status_code == 302, start.content[:300]
    authorize = start["Location"]
    asked = parse_qs(urlsplit(authorize).query)
    assert (asked["code_challenge_method"], asked["client_id"]) == (["S256"], [CLIENT_ID])  # PKCE
    at_provider = requests.Session()
    to_login = at_provider.get(authorize, allow_redirects=False)
    login_url = urljoin(authorize, to_login.headers["Location"])
    at_provider.get(login_url)
    signed_in = at_provider.post(
        login_url,
        data={
            "csrfmiddlewaretoken": at_provider.cookies["provider_csrf"],
            "username": username,
            "password": "provider-password",
            "next": parse_qs(urlsplit(login_url).query)["next"][0],
        },
        allow_redirects=False,
    )
    assert signed_in.status_code == 302, signed_in.text[:300]
    back = at_provider.get(urljoin(login_url, signed_in.headers["Location"]), allow_redirects=False)
    callback = back.headers["Location"]
    assert callback.startswith(f"{SITE}/accounts/oidc/callback/?"), callback
    return callback.removeprefix(SITE)


def signed_in_user(client: Client):
    user_id = client.session.get("_auth_user_id")
    return get_user_model().objects.get(pk=user_id) if user_id else None


def refusals() -> list[str]:
    return list(
        AuditEvent.objects.filter(action=Action.SIGN_IN_FAILED).order_by("id").values_list("detail__reason", flat=True)
    )


def test_a_first_sign_in_makes_the_user_of_the_subject_with_the_providers_groups(sso):
    subject = sso.user_set("aiko", groups=["finance", "hr"], email="aiko@example.jp", name="Aiko Sato")
    assert not Group.objects.exists()  # groups the site has never heard of: made, and marked as the provider's
    client = Client()

    landed = client.get(code_from_provider(client, sso, "aiko", next_url="/documents/"))

    assert (landed.status_code, landed["Location"]) == (302, "/documents/")
    user = signed_in_user(client)
    assert (user.username, user.email, user.first_name, user.last_name) == ("aiko", "aiko@example.jp", "Aiko", "Sato")
    assert not user.has_usable_password()
    identity = Identity.objects.get(user=user)
    assert (identity.issuer, identity.subject) == (sso.issuer, subject)
    assert sorted(user.groups.values_list("name", flat=True)) == ["finance", "hr"]
    assert set(ProvidedGroup.objects.values_list("group__name", "issuer")) == {
        ("finance", sso.issuer),
        ("hr", sso.issuer),
    }
    assert client.session.get_expiry_age() == 8 * 3600  # the provider is asked again after a working day
    event = AuditEvent.objects.get(action=Action.SIGN_IN)
    assert (event.actor, event.detail) == (f"user:{user.pk}", {"backend": "ragsite.identity.OpenIDBackend"})
    # Signed in, not sent back to the sign-in page: told to ask for a workspace.
    assert "You are not in any workspace yet" in client.get("/documents/").content.decode()


def test_groups_follow_the_claim_at_each_sign_in_and_groups_made_by_hand_stay(sso):
    sso.user_set("ben", groups=["finance", "hr"])
    client = Client()
    client.get(code_from_provider(client, sso, "ben"))
    ben = signed_in_user(client)
    by_hand = Group.objects.create(name="project-x")
    ben.groups.add(by_hand)

    sso.user_set("ben", groups=["finance", "legal"])
    again = Client()
    again.get(code_from_provider(again, sso, "ben"))

    assert signed_in_user(again) == ben
    assert sorted(ben.groups.values_list("name", flat=True)) == ["finance", "legal", "project-x"]
    sso.user_set("ben", groups=[])
    third = Client()
    third.get(code_from_provider(third, sso, "ben"))
    assert list(ben.groups.values_list("name", flat=True)) == ["project-x"]


def test_users_are_found_by_subject_never_by_email(sso):
    """An address that moves to another person at the provider signs them into their own
    account, not the one that had it; a person whose address changes keeps theirs."""
    chika = get_user_model().objects.create_user("chika", email="chika@example.jp", password="local-password-1")
    sso.user_set("mallory", email="chika@example.jp")
    client = Client()
    client.get(code_from_provider(client, sso, "mallory"))
    mallory = signed_in_user(client)
    assert mallory != chika and mallory.username == "mallory"

    sso.user_set("mallory", email="mallory@example.jp")
    again = Client()
    again.get(code_from_provider(again, sso, "mallory"))
    assert signed_in_user(again) == mallory
    mallory.refresh_from_db()
    assert mallory.email == "mallory@example.jp"
    assert get_user_model().objects.filter(email="chika@example.jp").get() == chika


def test_a_username_taken_here_gets_a_number(sso):
    get_user_model().objects.create_user("daichi", password="local-password-1")
    sso.user_set("daichi")
    client = Client()
    client.get(code_from_provider(client, sso, "daichi"))
    assert signed_in_user(client).username == "daichi-2"


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ({"expired": True}, "the ID token has expired"),
        (
            {"audience": "another-client"},
            "the ID token was issued for another client (its audience is not our client id)",
        ),
        ({"forged": True}, "the ID token's signature does not verify with the provider's published key"),
    ],
    ids=["expired", "wrong_audience", "forged"],
)
def test_a_bad_id_token_signs_nobody_in_and_the_reason_is_kept(sso, fault, reason):
    sso.user_set("eri", groups=["finance"])
    client = Client()
    callback = code_from_provider(client, sso, "eri")
    sso.faults_set(**fault)  # the token is minted when the site exchanges the code

    refused = client.get(callback)

    assert refused.status_code == 400
    assert "could not be accepted" in refused.content.decode()
    assert signed_in_user(client) is None
    assert refusals() == [reason]
    assert not get_user_model().objects.filter(username="eri").exists()


def test_a_replayed_callback_signs_nobody_in(sso):
    sso.user_set("fumi")
    sso.user_set("goro")
    fumi_browser, goro_browser = Client(), Client()
    callback = code_from_provider(fumi_browser, sso, "fumi")
    assert fumi_browser.get(callback).status_code == 302
    fumi = signed_in_user(fumi_browser)
    goro_browser.get(code_from_provider(goro_browser, sso, "goro"))
    goro = signed_in_user(goro_browser)

    replayed = fumi_browser.get(callback)  # the same browser: its state was used
    elsewhere = goro_browser.get(callback)  # another browser: it never started this sign-in
    fresh = Client().get(callback)  # a browser with no session at all

    assert (replayed.status_code, elsewhere.status_code, fresh.status_code) == (400, 400, 400)
    assert "used already or has expired" in replayed.content.decode()
    assert (signed_in_user(fumi_browser), signed_in_user(goro_browser)) == (fumi, goro)  # nobody became fumi again
    unknown_state = (
        "the callback's state is not one this browser is waiting for (replayed or expired): "
        "OIDC callback state not found in session `oidc_states`!"
    )
    no_session = "the callback came without a sign-in started in this browser (no state in its session)"
    assert refusals() == [unknown_state, unknown_state, no_session]


def test_a_code_used_twice_is_refused_by_the_provider(sso):
    """Two sign-ins started in one browser; the second's state brought back with the first's code."""
    sso.user_set("gen")
    client = Client()
    first = code_from_provider(client, sso, "gen")
    second = code_from_provider(client, sso, "gen")
    assert client.get(first).status_code == 302
    code = parse_qs(urlsplit(first).query)["code"][0]
    state = parse_qs(urlsplit(second).query)["state"][0]

    refused = client.get("/accounts/oidc/callback/", {"code": code, "state": state})

    assert refused.status_code == 400
    [reason] = refusals()
    assert reason.startswith("the provider refused the authorization code: ") and "invalid_grant" in reason


def test_the_provider_saying_no_and_a_deactivated_user(sso):
    sso.user_set("hana")
    client = Client()
    client.get(code_from_provider(client, sso, "hana"))
    hana = signed_in_user(client)
    client.post("/accounts/logout/")
    hana.is_active = False
    hana.save()

    deactivated = client.get(code_from_provider(client, sso, "hana"))
    start = client.get("/accounts/oidc/start/")
    state = parse_qs(urlsplit(start["Location"]).query)["state"][0]
    denied = client.get(
        "/accounts/oidc/callback/", {"error": "access_denied", "error_description": "no", "state": state}
    )

    assert (deactivated.status_code, denied.status_code) == (403, 403)
    assert signed_in_user(client) is None
    assert refusals() == [
        f"user {hana.pk} (hana) is deactivated",
        "the identity provider did not sign the user in (access_denied: no)",
    ]


def test_a_provider_that_is_down_is_said_and_passwords_still_sign_in(sso, settings):
    admin = get_user_model().objects.create_superuser("root", password="root-password-1")
    sso.user_set("isamu")
    client = Client()
    callback = code_from_provider(client, sso, "isamu")  # the code is issued...
    sso.stop()  # ...and the provider goes down before the site exchanges it
    try:
        token_endpoint_down = client.get(callback)
        settings.OIDC_DISCOVERY_URL = sso.discovery_url
        discovery_forget()
        discovery_down = client.get("/accounts/oidc/start/")
        by_password = Client()
        password = by_password.post("/accounts/login/", {"username": "root", "password": "root-password-1"})
    finally:
        sso.start()

    assert (token_endpoint_down.status_code, discovery_down.status_code) == (503, 503)
    assert "could not be reached" in discovery_down.content.decode()
    assert signed_in_user(client) is None
    token_reason, discovery_reason = refusals()
    assert token_reason.startswith("the identity provider could not be reached: ")
    assert discovery_reason.startswith(
        f"the identity provider's discovery document ({sso.discovery_url}) could not be read: "
    )
    assert (password.status_code, signed_in_user(by_password)) == (302, admin)
    assert list(get_user_model().objects.values_list("username", flat=True)) == ["root"]  # nothing made
    assert AuditEvent.objects.filter(action=Action.SIGN_IN, actor=f"user:{admin.pk}").count() == 1


def test_password_sign_in_can_be_kept_for_superusers_or_turned_off(sso, settings):
    get_user_model().objects.create_superuser("root", password="root-password-1")
    get_user_model().objects.create_user("jun", password="jun-password-1")

    def sign_in(username: str, password: str):
        client = Client()
        response = client.post("/accounts/login/", {"username": username, "password": password})
        return response.status_code, signed_in_user(client) is not None

    settings.PASSWORD_SIGN_IN = "superusers"
    assert sign_in("jun", "jun-password-1") == (200, False)
    assert sign_in("root", "root-password-1") == (302, True)
    settings.PASSWORD_SIGN_IN = "off"
    assert sign_in("root", "root-password-1") == (403, False)
    page = Client().get("/accounts/login/").content.decode()
    assert "Sign in with single sign-on" in page and 'name="password"' not in page
    assert Client().get("/admin/login/?next=/admin/")["Location"] == "/accounts/login/?next=%2Fadmin%2F"


def test_signing_out_ends_the_providers_session_too(sso):
    sso.user_set("kei")
    client = Client()
    client.get(code_from_provider(client, sso, "kei"))
    id_token = client.session["oidc_id_token"]

    out = client.post("/accounts/logout/")

    assert signed_in_user(client) is None
    end_session = urlsplit(out["Location"])
    assert f"{end_session.scheme}://{end_session.netloc}{end_session.path}" == f"{sso.issuer}/logout/"
    assert parse_qs(end_session.query) == {
        "id_token_hint": [id_token],
        "post_logout_redirect_uri": [f"{SITE}/accounts/login/"],
        "client_id": [CLIENT_ID],
    }
    assert AuditEvent.objects.filter(action=Action.SIGN_OUT).count() == 1


def test_without_a_discovery_url_there_is_no_single_sign_on(settings):
    settings.OIDC_DISCOVERY_URL = ""
    page = Client().get("/accounts/login/").content.decode()
    assert "Sign in with" not in page and 'name="password"' in page
    assert Client().get("/accounts/oidc/start/").status_code == 404
    assert Client().get("/accounts/oidc/callback/", {"code": "x", "state": "y"}).status_code == 404


def test_a_providers_group_given_a_workspace_lets_its_people_in_on_their_first_sign_in(sso):
    from search.models import Role, WorkspaceGroup
    from search.services import workspace_create

    workspace = workspace_create(name="Finance", slug="finance")
    WorkspaceGroup.objects.create(workspace=workspace, group=Group.objects.create(name="finance"), role=Role.VIEWER)
    sso.user_set("kana", groups=["finance"])
    client = Client()

    client.get(code_from_provider(client, sso, "kana"))

    page = client.get("/documents/").content.decode()
    assert "Documents in Finance" in page and 'id="viewer-notice"' in page


def test_a_user_deactivated_here_is_signed_out_at_their_next_request(sso):
    sso.user_set("lui")
    client = Client()
    client.get(code_from_provider(client, sso, "lui"))
    lui = signed_in_user(client)
    assert client.get("/documents/").status_code == 403  # signed in, in no workspace

    lui.is_active = False
    lui.save()

    assert client.get("/documents/")["Location"] == "/accounts/login/?next=/documents/"
