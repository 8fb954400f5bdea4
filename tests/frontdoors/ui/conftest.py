"""Tenants for the browser UI's tests: Acme (Ann) and Globex (Bob), each with a collection of
ingested documents, and Carol, a member of both."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.contrib.auth import get_user_model

from search.models import Membership
from search.services import collection_create, workspace_create
from tests.search.files import ingest_texts as ingest

PASSWORD = "correct horse battery staple"

ACME_DOCUMENTS = {
    "wing.md": "# Wing aerodynamics\n\nLift rises with the angle of attack until the wing stalls. "
    "The propeller slipstream increases the lift of the wing.",
    "robot.md": "# Atlas-7 robot\n\nThe Atlas-7 warehouse robot runs for 10 hours on one battery charge. "
    "Charging takes 90 minutes. <script>alert('robot')</script> is not markup here.",
}
GLOBEX_DOCUMENTS = {
    "secret.md": "# Globex plans\n\nThe Globex battery lasts 12 hours and charging takes 40 minutes.",
}


def member(username: str, *workspaces):
    user = get_user_model().objects.create_user(username, password=PASSWORD)
    for workspace in workspaces:
        Membership.objects.create(workspace=workspace, user=user)
    return user


@pytest.fixture
def tenants(db):
    acme = workspace_create(name="Acme", slug="acme")
    globex = workspace_create(name="Globex", slug="globex")
    # Every collection before any chunk: a vector index cannot be created while the chunk
    # table has pending trigger events in the same transaction.
    handbook = collection_create(workspace=acme, name="Handbook")
    manuals = collection_create(workspace=acme, name="Manuals")
    plans = collection_create(workspace=globex, name="Plans")
    ingest(handbook, ACME_DOCUMENTS)
    ingest(plans, GLOBEX_DOCUMENTS)
    return SimpleNamespace(
        acme=acme,
        globex=globex,
        handbook=handbook,
        manuals=manuals,
        plans=plans,
        ann=member("ann", acme),
        bob=member("bob", globex),
        carol=member("carol", acme, globex),
    )
