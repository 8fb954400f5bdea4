"""Starting prices, USD per million tokens, in force from 2025-01-01 (editable in the admin;
a change is a new row with its own date). Output prices are the figures users quote;
input prices are the providers' list prices at the time, to be checked by operators.
``local`` is an internal price for the GPU pool (amortised hardware and power); the
built-in embedding model is priced at 0 explicitly (a model without a price is flagged)."""

from datetime import UTC, datetime
from decimal import Decimal

from django.db import migrations

SINCE = datetime(2025, 1, 1, tzinfo=UTC)
PRICES = [
    ("deepseek-chat", "0.28", "0.42", "DeepSeek V3.2"),
    ("gemini-2.5-flash", "0.30", "2.50", "Gemini 2.5 Flash"),
    ("gpt-4.1", "2.00", "8.00", "GPT-4.1"),
    ("claude-sonnet-4-5", "3.00", "15.00", "Claude Sonnet 4.5"),
    ("local", "0.02", "0.10", "Local GPU pool (internal price: set it from your hardware and power costs)"),
    ("all-MiniLM-L6-v2", "0", "0", "The built-in embedding model, on the workers' CPUs (set a price to count them)"),
]


def seed(apps, schema_editor):
    Price = apps.get_model("billing", "Price")
    for model, input_price, output_price, note in PRICES:
        Price.objects.using(schema_editor.connection.alias).get_or_create(
            model=model,
            effective_from=SINCE,
            defaults={
                "input_usd_per_million": Decimal(input_price),
                "output_usd_per_million": Decimal(output_price),
                "note": note,
            },
        )


def unseed(apps, schema_editor):
    Price = apps.get_model("billing", "Price")
    for model, *_ in PRICES:
        Price.objects.using(schema_editor.connection.alias).filter(model=model, effective_from=SINCE).delete()


class Migration(migrations.Migration):
    dependencies = [("billing", "0002_client_keys_prices")]

    operations = [migrations.RunPython(seed, unseed)]
