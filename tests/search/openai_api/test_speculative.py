"""Speculative options of chat requests: both request forms, their validation, and the
settings they give a route's provider (no server, no database: unsaved providers)."""

from __future__ import annotations

import pytest

from inference.models import Provider
from search.openai_api import speculative
from search.openai_api.errors import ApiError


def remote(**fields) -> Provider:
    return Provider(
        name="upstream", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://up.example/v1", model="m", **fields
    )


def local(**fields) -> Provider:
    return Provider(name="pool", kind=Provider.Kind.LOCAL, model="tiny", **fields)


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        speculative.parse(body)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"enable_speculative": "yes"}, "enable_speculative"),
        ({"draft_model": ""}, "draft_model"),
        ({"draft_model": 7}, "draft_model"),
        ({"speculative_decoding": True}, "speculative_decoding"),
        ({"speculative_decoding": {"enabled": 1}}, "speculative_decoding.enabled"),
        ({"speculative_decoding": {"draft_tokens": 0}}, "speculative_decoding.draft_tokens"),
        ({"speculative_decoding": {"draft_tokens": 17}}, "speculative_decoding.draft_tokens"),
        ({"speculative_decoding": {"draft_tokens": 4.0}}, "speculative_decoding.draft_tokens"),
        ({"speculative_decoding": {"draft_tokens": True}}, "speculative_decoding.draft_tokens"),
        ({"speculative_decoding": {"temperature": -0.1}}, "speculative_decoding.temperature"),
        ({"speculative_decoding": {"temperature": "hot"}}, "speculative_decoding.temperature"),
        ({"speculative_decoding": {"draft_tokens": 4, "acceptance": 0.9}}, "speculative_decoding.acceptance"),
        ({"enable_speculative": False, "speculative_decoding": {"enabled": True}}, "speculative_decoding.enabled"),
    ],
)
def test_invalid_options_are_refused_naming_the_field(body, param):
    assert refused(body).param == param


def test_the_two_forms_read_alike_and_an_object_without_enabled_turns_speculation_on():
    assert speculative.parse({}) == speculative.SpeculativeRequest()
    assert not speculative.parse({}).given
    assert speculative.parse({"enable_speculative": True, "draft_model": " d "}).draft_model == "d"
    options = speculative.parse({"speculative_decoding": {"draft_tokens": 6, "temperature": 0}})
    assert (options.enabled, options.draft_tokens, options.temperature) == (True, 6, 0.0)
    assert speculative.parse({"draft_model": "d"}).enabled is True
    agreeing = speculative.parse({"enable_speculative": True, "speculative_decoding": {"enabled": True}})
    assert agreeing.enabled is True


def test_the_speculative_temperature_is_the_requests_temperature():
    options = speculative.parse({"speculative_decoding": {"temperature": 0.7}})
    assert speculative.temperature_for(options, None) == 0.7
    assert speculative.temperature_for(options, 0.7) == 0.7
    with pytest.raises(ApiError) as caught:
        speculative.temperature_for(options, 0.2)
    assert caught.value.param == "speculative_decoding.temperature"
    assert speculative.temperature_for(speculative.parse({}), 0.2) == 0.2


def override(body: dict, provider: Provider):
    return speculative.override_for(speculative.parse(body), provider, "default")


def test_options_map_onto_the_providers_settings():
    with_draft = remote(draft_model="d-1b")
    assert override({}, with_draft) is None
    assert override({"enable_speculative": False, "draft_model": "anything"}, with_draft) == {"method": "off"}
    # On, with nothing more: the provider's draft when it has one, else prompt lookup.
    assert override({"enable_speculative": True}, with_draft) == {"method": "draft", "k": 4, "draft_model": "d-1b"}
    assert override({"enable_speculative": True}, remote()) == {"method": "ngram", "k": 4}
    assert override({"speculative_decoding": {"draft_tokens": 9}}, remote()) == {"method": "ngram", "k": 9}
    assert override({"enable_speculative": True, "draft_model": "d-1b"}, with_draft) == {
        "method": "draft",
        "k": 4,
        "draft_model": "d-1b",
    }
    # A provider with speculation on keeps its method; the request sets k.
    both = local(draft_model="d", speculative_method=Provider.Speculative.BOTH, speculative_k=3)
    assert override({"speculative_decoding": {"draft_tokens": 5}}, both) == {
        "method": "both",
        "k": 5,
        "draft_model": "d",
    }
    assert override({"enable_speculative": True}, both) == {"method": "both", "k": 3, "draft_model": "d"}


def test_a_draft_model_other_than_the_routes_is_refused():
    for provider, message in [(remote(draft_model="d-1b"), "serves the draft model 'd-1b'"), (local(), "no draft")]:
        with pytest.raises(ApiError) as caught:
            override({"enable_speculative": True, "draft_model": "huge-70b"}, provider)
        assert (caught.value.status, caught.value.param) == (400, "draft_model")
        assert message in caught.value.message
