"""Fixtures of the REST API's tests: two workspaces, keys of any scopes, API clients, a small corpus."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from billing import client_keys
from search.services import collection_create, workspace_create

DOCUMENTS = {
    "wing.md": "# Wing aerodynamics\n\nLift rises with the angle of attack until the wing stalls. "
    "The propeller slipstream increases the lift of the wing.",
    "robot.md": "# Atlas-7 robot\n\nThe Atlas-7 warehouse robot runs for 10 hours on one battery charge. "
    "Charging takes 90 minutes.",
}


@pytest.fixture
def acme(db):
    return workspace_create(name="Acme", slug="acme")


@pytest.fixture
def other(db):
    return workspace_create(name="Other", slug="other")


@pytest.fixture
def handbook(acme):
    return collection_create(workspace=acme, name="Handbook")


@pytest.fixture
def theirs(other):
    """Another workspace's collection. Collections are created before any chunk is written in a
    test's transaction: a vector index cannot be created while the chunk table has pending
    trigger events."""
    return collection_create(workspace=other, name="Theirs")


@pytest.fixture
def make_key(acme):
    """``make_key("search", "generate", workspace=..., requests_per_minute=...)``: a new key's token."""

    def make(*scopes: str, workspace=None, **options) -> str:
        _, token = client_keys.client_key_create(workspace or acme, "test key", scopes=list(scopes), **options)
        return token

    return make


@pytest.fixture
def client_for():
    """``client_for(token)``: an API client sending ``Authorization: Bearer <token>``."""

    def make(token: str | None = None) -> APIClient:
        client = APIClient()
        if token is not None:
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        return client

    return make


@pytest.fixture
def admin_client(make_key, client_for):
    """A client with an admin key of workspace acme (every scope)."""
    return client_for(make_key("admin"))
