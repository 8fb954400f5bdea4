"""Upgrading keeps what an operator chose: migration inference 0007 makes a route to the demo
model, as ``manage.py up`` made it before routes declared their languages, answer in English
only, and leaves every other route as it is."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from inference.models import Provider, Route
from inference.serving import DEMO_ROUTE

pytestmark = pytest.mark.django_db(transaction=True)


def migrate(targets) -> None:
    MigrationExecutor(connection).migrate(targets)


def test_a_demo_route_made_before_languages_answers_in_english_after_the_upgrade():
    migrate([("inference", "0006_route_languages")])
    try:
        demo = Provider.objects.create(
            name="gpu-pool",
            kind=Provider.Kind.LOCAL,
            devices=["http://127.0.0.1:8100/v1"],
            model="/srv/ragsite/var/models/SmolLM2-135M-Instruct-0.1.0",
        )
        other = Provider.objects.create(
            name="hosted", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://127.0.0.1:9/v1", model="big-model"
        )
        as_made = Route.objects.create(
            name="gpu-pool", provider=demo, is_default=True, system_prompt=DEMO_ROUTE["system_prompt"]
        )
        edited = Route.objects.create(name="demo-edited", provider=demo, system_prompt="Answer in Japanese or English.")
        hosted = Route.objects.create(name="hosted", provider=other, system_prompt=DEMO_ROUTE["system_prompt"])
        chosen = Route.objects.create(
            name="chosen", provider=demo, system_prompt=DEMO_ROUTE["system_prompt"], languages=["ja", "en"]
        )
    finally:
        migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
    languages = dict(Route.objects.values_list("name", "languages"))
    assert languages == {
        as_made.name: ["en"],
        edited.name: [],
        hosted.name: [],
        chosen.name: ["ja", "en"],
    }
