"""Routes to the demo model made before routes declared their languages answer in English only.

``inference.serving.DEMO_ROUTE`` gives a new route to SmolLM2-135M-Instruct ``languages=["en"]``;
a route that ``manage.py up`` made before 0006 has ``[]`` (any language), so that model would be
sent Japanese questions it cannot answer. Only a route still as ``up`` made it (the demo's
instruction unchanged) is moved: one an operator has edited is theirs."""

from django.db import migrations

DEMO_MODEL = "SmolLM2-135M-Instruct"
DEMO_INSTRUCTION = "Answer the user's question in one sentence, using only this text:"


def demo_routes_in_english(apps, schema_editor):
    Route = apps.get_model("inference", "Route")
    Route.objects.using(schema_editor.connection.alias).filter(
        languages=[],
        provider__kind="local",
        provider__model__contains=DEMO_MODEL,
        system_prompt=DEMO_INSTRUCTION,
    ).update(languages=["en"])


class Migration(migrations.Migration):
    dependencies = [("inference", "0006_route_languages")]

    operations = [migrations.RunPython(demo_routes_in_english, migrations.RunPython.noop)]
