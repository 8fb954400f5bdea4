"""Django's ``migrate``, on the direct connection to PostgreSQL when ``DATABASE_DIRECT_URL``
is set (the "direct" database), so that migrations never go through a transaction-mode
pooler: ``manage.py migrate``, ``manage.py up`` and the chart's migration Job alike. An explicit
``--database`` still wins."""

from django.conf import settings
from django.core.management.commands.migrate import Command as DjangoMigrate


class Command(DjangoMigrate):
    def add_arguments(self, parser):
        super().add_arguments(parser)
        if "direct" in settings.DATABASES:
            parser.set_defaults(database="direct")
