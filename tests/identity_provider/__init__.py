"""An OpenID provider for the single sign-on tests: a small Django project of its own on
django-oauth-toolkit, run as its own process (``python -m tests.identity_provider.serve``),
with a control door the tests use to register the client, set users and groups, and make
it issue bad ID tokens (expired, for another client, signed by another key)."""
