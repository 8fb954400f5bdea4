"""``manage.py reembed COLLECTION_ID --model NAME``: move a collection to another embedding model."""

from __future__ import annotations

from django.core.management.base import CommandError
from tqdm import tqdm

from ragsite.commands import DatabaseCommand
from search.embedders import EmbedderError, embedder_get
from search.ingest.reembed import collection_reembed
from search.models import Collection


class Command(DatabaseCommand):
    help = "Re-embed every document of a collection with another model; searches keep working meanwhile."

    def add_arguments(self, parser):
        parser.add_argument("collection_id", type=int)
        parser.add_argument("--model", required=True, help="all-MiniLM-L6-v2 or openai:<model>.")

    def handle(self, *args, collection_id: int, model: str, **options):
        try:
            collection = Collection.objects.get(pk=collection_id)
            embedder_get(model)
        except Collection.DoesNotExist:
            raise CommandError(f"no collection with id {collection_id}") from None
        except EmbedderError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{collection}: {collection.embedding_model} -> {model}")
        with tqdm(unit="doc", desc="reembed", disable=None) as bar:

            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            collection = collection_reembed(collection_id=collection_id, model=model, on_progress=progress)
        self.stdout.write(f"{collection}: now {collection.embedding_model}, {collection.chunk_count} chunks")
