from django.db import migrations

# The restricted documents of a collection (search.access.RESTRICTED_SQL), read on every
# search that has a reader (search.selectors._readable): a collection open to its whole
# workspace has none, and the count costs one probe of this index.
INDEX = "CREATE INDEX CONCURRENTLY IF NOT EXISTS document_restricted ON search_document (collection_id) WHERE {where}"


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("search", "0012_chunk_readers_gin")]

    operations = [
        migrations.RunSQL(
            INDEX.format(where="NOT (readers @> '{*}'::varchar[])"),
            "DROP INDEX CONCURRENTLY IF EXISTS document_restricted",
        )
    ]
