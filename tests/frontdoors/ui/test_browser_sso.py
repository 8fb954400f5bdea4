"""Single sign-on in a real browser: headless Chromium signs in at the test OpenID provider
(tests/identity_provider/, its own process) through the site under uvicorn, set up by its
environment as the README says, sees what the provider's groups let it read, and signs out
of both."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from search.access import readers_for
from search.models import Role, WorkspaceGroup
from search.services import collection_create, document_readers_set, workspace_create
from tests.browser import console_errors, wait_until
from tests.identity_provider.process import IdentityProvider
from tests.search.files import ingest_texts

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]  # the server sees committed rows


def test_sign_in_with_the_provider_read_by_its_groups_and_sign_out_of_both(browser, start_web, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as shown

    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Plans")
    budget, _ = ingest_texts(
        collection,
        {"budget-2027.md": "The 2027 budget grows by four percent.", "handbook.md": "The office opens at nine."},
    )
    # Made by hand before anyone signed in; the provider then names them. Everyone on the staff
    # reads the workspace; only finance reads the budget.
    staff = Group.objects.create(name="staff")
    Group.objects.create(name="finance")
    WorkspaceGroup.objects.create(workspace=workspace, group=staff, role=Role.VIEWER)
    document_readers_set(document=collection.documents.get(pk=budget), readers=readers_for(groups=["finance"]))

    provider = IdentityProvider(tmp_path / "provider")
    provider.start()
    try:
        provider.user_set("aiko", groups=["staff", "finance"], email="aiko@example.jp", name="Aiko Sato")
        provider.user_set("bo", groups=["staff"], email="bo@example.jp", name="Bo Tanaka")
        client = {"OIDC_CLIENT_ID": "rag-search", "OIDC_CLIENT_SECRET": "secret-of-the-relying-party-0123456789"}
        env = {"OIDC_DISCOVERY_URL": provider.discovery_url, "OIDC_PROVIDER_NAME": "Acme ID", **client}
        with start_web(env=env) as base_url:
            provider.client_set(client["OIDC_CLIENT_ID"], client["OIDC_CLIENT_SECRET"], base_url)

            def sign_in(username: str) -> str:
                """Signs in at the provider from the site's documents page; the documents listed."""
                browser.get(f"{base_url}/documents/")
                assert "/accounts/login/" in browser.current_url
                browser.find_element(By.ID, "sso-sign-in").click()
                wait_until(browser, shown.presence_of_element_located((By.ID, "provider-username")))
                assert browser.current_url.startswith(provider.base_url)
                browser.find_element(By.ID, "provider-username").send_keys(username)
                browser.find_element(By.ID, "provider-password").send_keys("provider-password")
                browser.find_element(By.ID, "provider-sign-in").click()
                listed = wait_until(browser, shown.presence_of_element_located((By.ID, "document-list")))
                assert browser.current_url == f"{base_url}/documents/"
                return listed.text

            def sign_out() -> None:
                browser.find_element(By.XPATH, "//button[normalize-space()='Log out']").click()
                wait_until(browser, shown.presence_of_element_located((By.ID, "id_username")))
                assert browser.current_url == f"{base_url}/accounts/login/"

            # Aiko's first sign-in: her groups come from the provider, the staff group gives her
            # the workspace, finance the budget.
            listed = sign_in("aiko")
            assert "budget-2027.md" in listed and "handbook.md" in listed
            console_errors(browser)  # read away: the provider's page asks for a favicon it does not have
            browser.refresh()
            wait_until(browser, shown.presence_of_element_located((By.ID, "document-list")))
            assert console_errors(browser) == []
            sign_out()
            # Signed out at the provider too: Bo signs in with his own password, and sees no budget.
            listed = sign_in("bo")
            assert "handbook.md" in listed and "budget-2027.md" not in listed
            sign_out()
        users = get_user_model().objects
        assert sorted(users.filter(identities__issuer=provider.issuer).values_list("username", flat=True)) == [
            "aiko",
            "bo",
        ]
        assert sorted(users.get(username="aiko").groups.values_list("name", flat=True)) == ["finance", "staff"]
    finally:
        provider.stop()
