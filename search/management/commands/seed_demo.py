"""Load the demo corpus shipped in ``demo/corpus`` into the "Demo" workspace (idempotent).

English files go to the handbook, Japanese ones to the company's Japanese documents: a
collection is embedded by one model, chosen by its first document's language
(search/ingest/pipeline.py), and each language's files read best with their own."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from ragsite.commands import DatabaseCommand
from search.analysis import JAPANESE, language_of
from search.services import collection_create, document_create, workspace_create

DEMO_CORPUS = Path(settings.BASE_DIR) / "demo" / "corpus"


class Command(DatabaseCommand):
    help = "Load the shipped demo corpus into the Demo workspace; running it again changes nothing."

    def handle(self, *args, **options):
        workspace = workspace_create(name="Demo", slug="demo")
        collections = {
            "en": collection_create(
                workspace=workspace,
                name="Northwind handbook",
                description="Fictional company handbook shipped as a demo.",
            ),
            JAPANESE: collection_create(
                workspace=workspace,
                name="ノースウィンド社内文書",
                description="デモ用の架空の会社の社内文書（売上報告、経費精算規程など）。",
            ),
        }
        created = existing = 0
        for path in sorted(p for p in DEMO_CORPUS.iterdir() if p.is_file()):
            content = path.read_bytes()
            language = JAPANESE if language_of(content.decode("utf-8", errors="ignore")) == JAPANESE else "en"
            _, was_created = document_create(collection=collections[language], source_name=path.name, content=content)
            created += was_created
            existing += not was_created
        self.stdout.write(f"demo corpus: {created} documents added, {existing} already present")
