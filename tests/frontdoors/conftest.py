"""The front doors' tests share the search tests' tenants and store uploads the same way: in
each test's own folder (tests/search/conftest.py)."""

from tests.search.conftest import _media_in_tmp, collection, workspace  # noqa: F401 (pytest fixtures)
