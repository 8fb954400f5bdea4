"""Speculative options of chat requests: both request forms, their validation, and the
endpoint they choose among the route model's (providers in the database, no server)."""

from __future__ import annotations

import pytest

from frontdoors.openai_api import speculative
from frontdoors.openai_api.errors import OpenAIError, from_domain
from inference import router
from inference.errors import SpeculationUnavailable
from inference.models import Provider, Route


def refused(body: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
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
    with pytest.raises(OpenAIError) as caught:
        speculative.temperature_for(options, 0.2)
    assert caught.value.param == "speculative_decoding.temperature"
    assert speculative.temperature_for(speculative.parse({}), 0.2) == 0.2


def pool(name: str, **fields) -> Provider:
    fields = {"model": "m", **fields}
    return Provider.objects.create(name=name, kind="local", devices=[f"http://{name}:8000/v1"], **fields)


def chosen(body: dict, route: Route) -> Provider:
    """The endpoint the request's options choose: the request read here, decided by the plan."""
    options = speculative.wanted(speculative.parse(body))
    return router.plan(route_name=route.name, speculative=options).provider


@pytest.mark.django_db
def test_options_choose_among_the_pools_of_the_routes_model():
    ngram = pool("ngram", speculative_method="ngram", speculative_k=4)
    plain = pool("plain")
    drafted = pool("drafted", speculative_method="draft", draft_model="d-1b", speculative_k=3)
    pool("other-model", speculative_method="ngram", speculative_k=8, model="m2")
    pool("disabled", speculative_method="ngram", speculative_k=8, enabled=False)
    route = Route.objects.create(name="default", provider=ngram, is_default=True)

    assert speculative.wanted(speculative.parse({})) is None
    assert chosen({}, route) == ngram
    assert chosen({"enable_speculative": True}, route) == ngram
    assert chosen({"speculative_decoding": {"draft_tokens": 4}}, route) == ngram
    assert chosen({"enable_speculative": False, "draft_model": "anything"}, route) == plain
    assert chosen({"enable_speculative": True, "draft_model": "d-1b"}, route) == drafted
    assert chosen({"speculative_decoding": {"draft_tokens": 3}}, route) == drafted


@pytest.mark.django_db
def test_options_no_pool_of_the_model_serves_are_refused_naming_the_field():
    route = Route.objects.create(
        name="default", provider=pool("ngram", speculative_method="ngram", speculative_k=4), is_default=True
    )
    pool("disabled", speculative_method="ngram", speculative_k=8, enabled=False)
    pool("other-model", speculative_method="ngram", speculative_k=8, model="m2")
    for body, param, says in [
        ({"speculative_decoding": {"draft_tokens": 8}}, "speculative_decoding.draft_tokens", "proposes 4 tokens"),
        ({"enable_speculative": False}, "enable_speculative", "decodes speculatively (ngram)"),
        ({"enable_speculative": True, "draft_model": "huge-70b"}, "draft_model", "has no draft model"),
    ]:
        with pytest.raises(SpeculationUnavailable) as refused:
            chosen(body, route)
        caught = from_domain(refused.value)  # what the endpoint answers
        assert (caught.status, caught.param) == (400, param)
        assert caught.code == ("model_not_found" if param == "draft_model" else "invalid_value")
        assert says in caught.message and "there is no other" in caught.message
