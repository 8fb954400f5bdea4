"""Production settings: `check --deploy` is clean, DEBUG is off unless asked for, and a live
web process sends HTTPS-only cookies, HSTS and the content security policy, and refuses a
form posted without its CSRF token. Every form of the site carries the token, and every
view that skips Django's CSRF check authenticates by bearer key only (or enforces CSRF
itself for sessions, as DRF does)."""

from __future__ import annotations

import http.client
import json
import re
import secrets
import urllib.parse

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from tests.conftest import PROJECT_ROOT
from tests.ragsite.test_settings_startup import run_manage

PRODUCTION = {"RAGSITE_ENV": "production", "SECRET_KEY": secrets.token_urlsafe(50)}


def settings_in_a_fresh_process(**env: str) -> dict:
    """The security settings as a process started with ``env`` (and nothing else set) reads them."""
    names = [
        "DEBUG", "ENVIRONMENT", "SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE",
        "SECURE_HSTS_SECONDS", "SECURE_HSTS_INCLUDE_SUBDOMAINS", "SECURE_HSTS_PRELOAD",
    ]  # fmt: skip
    script = (
        "import json; from django.conf import settings; "
        f"print(json.dumps({{n: getattr(settings, n) for n in {names!r}}}))"
    )
    unset = {
        name: "" for name in ("DEBUG", "RAGSITE_ENV", "SECURE_SSL_REDIRECT", "SECURE_COOKIES", "SECURE_HSTS_SECONDS")
    }
    result = run_manage("shell", "-c", script, **{**unset, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_check_deploy_is_clean_under_production_settings():
    result = run_manage("check", "--deploy", "--fail-level", "WARNING", **PRODUCTION)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_production_is_the_default_and_debug_is_off_outside_development():
    assert settings_in_a_fresh_process(SECRET_KEY=PRODUCTION["SECRET_KEY"]) == {
        "DEBUG": False,
        "ENVIRONMENT": "production",
        "SECURE_SSL_REDIRECT": True,
        "SESSION_COOKIE_SECURE": True,
        "CSRF_COOKIE_SECURE": True,
        "SECURE_HSTS_SECONDS": 31_536_000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
        "SECURE_HSTS_PRELOAD": True,
    }
    development = settings_in_a_fresh_process(RAGSITE_ENV="development")
    assert development["DEBUG"] is False  # plain HTTP on a laptop, still no debug pages unless asked
    assert (development["SECURE_SSL_REDIRECT"], development["SESSION_COOKIE_SECURE"]) == (False, False)
    assert development["SECURE_HSTS_SECONDS"] == 0


def test_dev_py_runs_development_and_compose_runs_production():
    import yaml

    assert 'os.environ.setdefault("RAGSITE_ENV", "development")' in (PROJECT_ROOT / "dev.py").read_text()
    compose = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
    assert compose["x-app"]["environment"]["RAGSITE_ENV"] == "production"


def _request(base_url: str, method: str, path: str, *, headers=None, body: str | None = None):
    host, port = urllib.parse.urlsplit(base_url).netloc.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read().decode()
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_production_web_process_sends_the_security_headers(start_web):
    User.objects.create_user("ann", password="a long enough password 1")
    env = {**PRODUCTION, "BEHIND_TLS_PROXY": "true"}
    with start_web(env=env) as base_url:
        # Plain HTTP is sent to HTTPS; the probes are not (they come from inside the deployment).
        status, headers, _ = _request(base_url, "GET", "/accounts/login/")
        assert status == 301
        assert headers["Location"] == f"https://{urllib.parse.urlsplit(base_url).netloc}/accounts/login/"
        assert _request(base_url, "GET", "/healthz")[0] == 200

        # Through the TLS proxy: HSTS, the policy, and cookies only over HTTPS.
        https = {"X-Forwarded-Proto": "https"}
        status, headers, page = _request(base_url, "GET", "/accounts/login/", headers=https)
        assert status == 200
        assert headers["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains; preload"
        policy = dict(part.strip().split(" ", 1) for part in headers["Content-Security-Policy"].split(";"))
        assert policy["script-src"] == "'self'"
        assert policy["object-src"] == "'none'"
        assert policy["frame-ancestors"] == "'none'"
        assert headers["X-Frame-Options"] == "DENY"
        assert headers["X-Content-Type-Options"] == "nosniff"
        (csrf_cookie,) = headers.get_all("Set-Cookie")
        assert csrf_cookie.startswith("csrftoken=") and "; Secure" in csrf_cookie
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        cookie = csrf_cookie.split(";", 1)[0]

        # A login posted without the form's token is refused; with it, the session cookie is
        # HTTPS-only and hidden from scripts.
        form = {
            "Content-Type": "application/x-www-form-urlencoded",
            "Referer": f"https://{urllib.parse.urlsplit(base_url).netloc}/accounts/login/",
        }
        login = urllib.parse.urlencode({"username": "ann", "password": "a long enough password 1"})
        status, _, _ = _request(
            base_url, "POST", "/accounts/login/", headers={**https, **form, "Cookie": cookie}, body=login
        )
        assert status == 403
        body = login + "&" + urllib.parse.urlencode({"csrfmiddlewaretoken": token})
        status, headers, _ = _request(
            base_url, "POST", "/accounts/login/", headers={**https, **form, "Cookie": cookie}, body=body
        )
        assert status == 302
        session = next(value for value in headers.get_all("Set-Cookie") if value.startswith("sessionid="))
        assert "; Secure" in session and "; HttpOnly" in session


# --------------------------------------------------------------------------- CSRF on every form

TEMPLATE_DIRS = [PROJECT_ROOT / "templates", *PROJECT_ROOT.glob("*/templates")]


def test_every_post_form_in_the_templates_carries_the_csrf_token():
    forms = 0
    for template in sorted(path for folder in TEMPLATE_DIRS for path in folder.rglob("*.html")):
        for form in re.finditer(r"<form\b[^>]*>.*?</form>", template.read_text(), flags=re.S | re.I):
            if re.search(r'method="post"', form.group(0), flags=re.I):
                forms += 1
                assert "{% csrf_token %}" in form.group(0), (
                    f"{template.relative_to(PROJECT_ROOT)}: {form.group(0)[:120]}"
                )
    assert forms >= 7  # login, logout, workspace switch, upload, retry, delete, ask (counted when written)


def _patterns(resolver=None, prefix: str = ""):
    for pattern in (resolver or get_resolver()).url_patterns:
        if isinstance(pattern, URLResolver):
            yield from _patterns(pattern, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern


def _view_class(pattern: URLPattern):
    return getattr(pattern.callback, "cls", None) or getattr(pattern.callback, "view_class", None)


def test_views_exempt_from_django_csrf_take_bearer_keys_or_check_csrf_themselves():
    from rest_framework.views import APIView

    exempt = {route: pattern for route, pattern in _patterns() if getattr(pattern.callback, "csrf_exempt", False)}
    drf = {
        route
        for route, pattern in exempt.items()
        if isinstance(_view_class(pattern), type) and issubclass(_view_class(pattern), APIView)
    }
    bearer_only = {route for route in exempt if route.startswith("v1/")}  # the OpenAI-compatible API
    # Answer nothing but their own error to an unsafe method (checked in the next test), so
    # that API clients get JSON instead of Django's HTML 403.
    change_nothing = {"api/v1/answers/<uuid:answer_id>/stream", "api/^v1/"}
    unexplained = set(exempt) - drf - bearer_only - change_nothing
    assert not unexplained, f"views exempt from CSRF for no known reason: {sorted(unexplained)}"
    # DRF checks CSRF itself for session-authenticated requests (SessionAuthentication).
    # No HTTP Basic either: passwords are typed into the login form only.
    for route in drf:
        names = {cls.__name__ for cls in _view_class(exempt[route]).authentication_classes}
        assert names <= {"SessionAuthentication", "ClientKeyAuthentication"}, (route, names)


@pytest.mark.django_db
def test_a_logged_in_session_cannot_post_without_the_csrf_token():
    from search.models import Collection
    from search.services import collection_create, workspace_create
    from tests.frontdoors.ui.conftest import member

    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(member("ann", workspace))
    refused = {
        "/workspace/": {"workspace": workspace.slug},
        "/ask/": {"q": "battery"},
        "/documents/upload/": {"collection": collection.pk},
        "/accounts/logout/": {},
        "/api/v1/collections": {"name": "Forged"},
    }
    for path, data in refused.items():
        response = browser.post(path, data)
        assert response.status_code == 403, (path, response.status_code)
    assert list(Collection.objects.values_list("name", flat=True)) == ["Handbook"]
    # The two read-only views exempt from Django's check refuse unsafe methods in the API's shape.
    stream = browser.post("/api/v1/answers/00000000-0000-0000-0000-000000000000/stream")
    assert (stream.status_code, stream.json()["error"]["code"]) == (405, "method_not_allowed")
    unknown = browser.post("/api/v1/anything")
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "not_found")
    # The OpenAI-compatible API takes no session at all: a browser's cookies cannot use it.
    response = browser.post("/v1/chat/completions", {"model": "rag", "messages": []}, content_type="application/json")
    assert response.status_code == 401
