"""Load the demo corpus shipped in ``demo/corpus`` into the "Demo" workspace (idempotent)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from ragsite.commands import DatabaseCommand
from search.services import collection_create, document_create, workspace_create

DEMO_CORPUS = Path(settings.BASE_DIR) / "demo" / "corpus"


class Command(DatabaseCommand):
    help = "Load the shipped demo corpus into the Demo workspace; running it again changes nothing."

    def handle(self, *args, **options):
        workspace = workspace_create(name="Demo", slug="demo")
        collection = collection_create(
            workspace=workspace, name="Northwind handbook", description="Fictional company handbook shipped as a demo."
        )
        created = existing = 0
        for path in sorted(p for p in DEMO_CORPUS.iterdir() if p.is_file()):
            _, was_created = document_create(collection=collection, source_name=path.name, content=path.read_bytes())
            created += was_created
            existing += not was_created
        self.stdout.write(f"demo corpus: {created} documents added, {existing} already present")
