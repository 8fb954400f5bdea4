"""Single sign-on in a real browser: headless Chromium signs in at the test OpenID provider
(tests/identity_provider/, its own process) through the site under uvicorn, set up by its
environment as the README says, sees what the provider's groups let it read, and signs out
of both."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from search.access import readers_for
from search.models import Membership
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
    budget, salaries = ingest_texts(
        collection,
        {"budget-2027.md": "The 2027 budget grows by four percent.", "salaries.md": "Salary bands for 2027."},
    )
    Group.objects.create(name="finance")  # made by hand before anyone signed in; the provider then names it
    Group.objects.create(name="hr")
    document_readers_set(document=collection.documents.get(pk=budget), readers=readers_for(groups=["finance"]))
    document_readers_set(document=collection.documents.get(pk=salaries), readers=readers_for(groups=["hr"]))

    provider = IdentityProvider(tmp_path / "provider")
    provider.start()
    try:
        provider.user_set("aiko", groups=["finance"], email="aiko@example.jp", name="Aiko Sato")
        client = {"OIDC_CLIENT_ID": "rag-search", "OIDC_CLIENT_SECRET": "secret-of-the-relying-party-0123456789"}
        env = {"OIDC_DISCOVERY_URL": provider.discovery_url, "OIDC_PROVIDER_NAME": "Acme ID", **client}
        with start_web(env=env) as base_url:
            provider.client_set(client["OIDC_CLIENT_ID"], client["OIDC_CLIENT_SECRET"], base_url)
            browser.get(f"{base_url}/documents/")
            assert "/accounts/login/" in browser.current_url
            browser.find_element(By.ID, "sso-sign-in").click()
            wait_until(browser, shown.presence_of_element_located((By.ID, "provider-username")))
            assert browser.current_url.startswith(provider.base_url)
            browser.find_element(By.ID, "provider-username").send_keys("aiko")
            browser.find_element(By.ID, "provider-password").send_keys("provider-password")
            browser.find_element(By.ID, "provider-sign-in").click()

            # Back at the site, signed in as the provider's user, who is in no workspace yet.
            wait_until(
                browser, shown.text_to_be_present_in_element((By.TAG_NAME, "h1"), "You are not in any workspace yet")
            )
            assert browser.current_url == f"{base_url}/documents/"
            from django.contrib.auth import get_user_model

            aiko = get_user_model().objects.get(identities__subject__isnull=False, username="aiko")
            Membership.objects.create(workspace=workspace, user=aiko)
            console_errors(browser)  # read away: the provider's page asks for a favicon it lacks, the last was a 403
            browser.get(f"{base_url}/documents/")
            listed = wait_until(browser, shown.presence_of_element_located((By.ID, "document-list")))
            assert "budget-2027.md" in listed.text and "salaries.md" not in listed.text
            assert console_errors(browser) == []

            browser.find_element(By.XPATH, "//button[normalize-space()='Log out']").click()
            wait_until(browser, shown.presence_of_element_located((By.ID, "id_username")))
            assert browser.current_url == f"{base_url}/accounts/login/"
            # Signed out at the provider too: starting again asks for the password again.
            browser.find_element(By.ID, "sso-sign-in").click()
            wait_until(browser, shown.presence_of_element_located((By.ID, "provider-username")))
    finally:
        provider.stop()
