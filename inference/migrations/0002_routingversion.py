"""The routing version (``inference.models.RoutingVersion``): a sequence, the row, and the
triggers that move it on every change a plan depends on."""

from django.db import migrations, models

BUMP = """
CREATE SEQUENCE inference_routing_version_seq;
CREATE FUNCTION inference_routing_version_bump() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO inference_routingversion (id, version) VALUES (1, nextval('inference_routing_version_seq'))
    ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version;
    RETURN NULL;
END $$;
INSERT INTO inference_routingversion (id, version) VALUES (1, nextval('inference_routing_version_seq'));
"""

# Every change to these tables; one bump per statement.
WHOLE_TABLES = ("inference_provider", "inference_route", "inference_routefallback", "inference_canaryrelease")
TRIGGERS = "".join(
    f"""
CREATE TRIGGER {table}_routing_version AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION inference_routing_version_bump();
"""
    for table in WHOLE_TABLES
) + """
CREATE TRIGGER inference_upstreamkey_routing_version AFTER INSERT OR DELETE OR TRUNCATE ON inference_upstreamkey
    FOR EACH STATEMENT EXECUTE FUNCTION inference_routing_version_bump();
-- A pick rewrites last_used_at (and an active key's status to itself) on every request:
-- only a change of whether or where the key can be used counts.
CREATE TRIGGER inference_upstreamkey_usable_version AFTER UPDATE ON inference_upstreamkey
    FOR EACH ROW WHEN (
        OLD.status IS DISTINCT FROM NEW.status
        OR OLD.cooldown_until IS DISTINCT FROM NEW.cooldown_until
        OR OLD.provider_id IS DISTINCT FROM NEW.provider_id
    ) EXECUTE FUNCTION inference_routing_version_bump();
"""

DROP = (
    "".join(f"DROP TRIGGER IF EXISTS {table}_routing_version ON {table};" for table in WHOLE_TABLES)
    + "DROP TRIGGER IF EXISTS inference_upstreamkey_routing_version ON inference_upstreamkey;"
    + "DROP TRIGGER IF EXISTS inference_upstreamkey_usable_version ON inference_upstreamkey;"
    + "DROP FUNCTION IF EXISTS inference_routing_version_bump();"
    + "DROP SEQUENCE IF EXISTS inference_routing_version_seq;"
)


class Migration(migrations.Migration):
    dependencies = [("inference", "0001_initial")]

    operations = [
        migrations.CreateModel(
            name="RoutingVersion",
            fields=[
                ("id", models.PositiveSmallIntegerField(default=1, primary_key=True, serialize=False)),
                ("version", models.BigIntegerField()),
            ],
            options={"db_table": "inference_routingversion"},
        ),
        migrations.RunSQL(BUMP + TRIGGERS, reverse_sql=DROP),
    ]
