from __future__ import annotations

import pytest

from search.services import collection_create, workspace_create


@pytest.fixture
def workspace(db):
    return workspace_create(name="Acme", slug="acme")


@pytest.fixture
def collection(workspace):
    return collection_create(workspace=workspace, name="Handbook")


@pytest.fixture(autouse=True)
def _media_in_tmp(settings, tmp_path):
    """Uploaded files of each test land in its own folder."""
    settings.MEDIA_ROOT = tmp_path / "media"
