"""The base of the management commands that read or write the apps' tables."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor


class DatabaseCommand(BaseCommand):
    """Refuses, naming the fix, to run on a database that lacks migrations, where the first
    query would fail with a traceback ("relation ... does not exist"). Django's own
    ``requires_migrations_checks`` computes the same plan but only prints a notice and runs on."""

    def execute(self, *args, **options):
        connection = connections[DEFAULT_DB_ALIAS]
        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
        if plan:
            names = ", ".join(f"{migration.app_label}.{migration.name}" for migration, _ in plan[:3])
            more = f" and {len(plan) - 3} more" if len(plan) > 3 else ""
            raise CommandError(
                f"database {connection.settings_dict['NAME']!r} lacks {len(plan)} migration(s) ({names}{more}): "
                "run `python manage.py migrate` first (`python3 dev.py up` migrates by itself)"
            )
        return super().execute(*args, **options)
