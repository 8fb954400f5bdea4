# Client ids name their kind (search.answering.conversations.client_id_of): "user:<id>" or "key:<id>".
# A bare number was a user's or an API key's id, and the two could be the same number: key 1
# listed, and could continue, user 1's conversations. Written by hand.

from django.db import migrations

# A bare number is the owner's (asker's) id when it is that user's, else an API key's: the
# doors recorded a session's user or a key, and a row with a key has no owner. Other values
# (a test's or a tool's own label, "") are left as they are.
NAMED = """
UPDATE search_conversation SET client_id = CASE
    WHEN owner_id IS NOT NULL AND client_id = owner_id::text THEN 'user:' || client_id
    ELSE 'key:' || client_id END
WHERE client_id ~ '^[0-9]+$';
UPDATE search_answer SET client_id = CASE
    WHEN asker_id IS NOT NULL AND client_id = asker_id::text THEN 'user:' || client_id
    ELSE 'key:' || client_id END
WHERE client_id ~ '^[0-9]+$';
"""

BARE = """
UPDATE search_conversation SET client_id = substring(client_id FROM '^(?:user|key):([0-9]+)$')
WHERE client_id ~ '^(user|key):[0-9]+$';
UPDATE search_answer SET client_id = substring(client_id FROM '^(?:user|key):([0-9]+)$')
WHERE client_id ~ '^(user|key):[0-9]+$';
"""


class Migration(migrations.Migration):
    dependencies = [("search", "0008_conversations")]

    operations = [migrations.RunSQL(NAMED, reverse_sql=BARE)]
