import re
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from ragsite import env


@pytest.mark.parametrize(
    ("raw", "expected"), [("true", True), ("1", True), ("YES", True), ("off", False), ("0", False)]
)
def test_env_bool_accepts_the_usual_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("FLAG", raw)
    assert env.env_bool("FLAG", not expected) is expected


def test_env_bool_rejects_anything_else_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured) as excinfo:
        env.env_bool("FLAG", False)
    assert str(excinfo.value) == "FLAG must be a boolean (true/false, 1/0, yes/no, on/off), got 'maybe'"


def test_unset_and_blank_values_take_the_default(monkeypatch):
    monkeypatch.delenv("NUMBER", raising=False)
    assert env.env_int("NUMBER", 7) == 7
    monkeypatch.setenv("NUMBER", "   ")
    assert env.env_int("NUMBER", 7) == 7


def test_env_int_checks_type_and_bounds(monkeypatch):
    monkeypatch.setenv("NUMBER", "12")
    assert env.env_int("NUMBER", 1, minimum=1, maximum=20) == 12
    monkeypatch.setenv("NUMBER", "twelve")
    with pytest.raises(ImproperlyConfigured, match=r"^NUMBER must be an integer, got 'twelve'$"):
        env.env_int("NUMBER", 1)
    monkeypatch.setenv("NUMBER", "0")
    with pytest.raises(ImproperlyConfigured, match=r"^NUMBER must be an integer >= 1, got '0'$"):
        env.env_int("NUMBER", 1, minimum=1)


def test_env_list_splits_and_refuses_empty_items(monkeypatch):
    monkeypatch.setenv("HOSTS", "a.example, b.example")
    assert env.env_list("HOSTS", []) == ["a.example", "b.example"]
    monkeypatch.setenv("HOSTS", "a.example,,b.example")
    with pytest.raises(ImproperlyConfigured, match="HOSTS must be a comma-separated list without empty items"):
        env.env_list("HOSTS", [])


def test_env_url_checks_the_scheme_and_hides_the_password(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "mysql://app:hunter2@db/app")
    with pytest.raises(ImproperlyConfigured) as excinfo:
        env.env_url("DATABASE_URL", ("postgres", "postgresql"))
    message = str(excinfo.value)
    assert (
        message == "DATABASE_URL must be a URL starting with postgres:// or postgresql://, got 'mysql://app:***@db/app'"
    )
    assert "hunter2" not in message


def test_env_decimal_and_choice(monkeypatch):
    monkeypatch.setenv("PRICE", "0.42")
    assert env.env_decimal("PRICE", Decimal("0")) == Decimal("0.42")
    monkeypatch.setenv("PRICE", "cheap")
    with pytest.raises(ImproperlyConfigured, match="PRICE must be a decimal number, got 'cheap'"):
        env.env_decimal("PRICE", Decimal("0"))
    monkeypatch.setenv("LEVEL", "LOUD")
    with pytest.raises(ImproperlyConfigured, match="LEVEL must be one of DEBUG, INFO, got 'LOUD'"):
        env.env_choice("LEVEL", "INFO", ("DEBUG", "INFO"))


# Read by the settings but set by the project itself, not by an operator.
INTERNAL_VARIABLES = {"RAGSITE_SERVER"}  # ragsite/asgi.py marks its own processes


def test_every_variable_the_settings_read_is_in_env_example():
    """.env.example lists every setting with its meaning and default (the README says so)."""
    root = Path(__file__).resolve().parents[2]
    source = (root / "ragsite" / "settings.py").read_text()
    read = set(re.findall(r'(?:env_\w+|os\.environ\.get)\(\s*"([A-Z][A-Z0-9_]*)"', source)) - INTERNAL_VARIABLES
    listed = set(re.findall(r"^#?\s?([A-Z][A-Z0-9_]*)=", (root / ".env.example").read_text(), re.MULTILINE))
    assert len(read) > 80  # the pattern finds them
    assert sorted(read - listed) == []
