"""``manage.py reanalyze [COLLECTION_ID ...] [--language auto|ja|en]``: analyse chunks again."""

from __future__ import annotations

from django.core.management.base import CommandError
from tqdm import tqdm

from ragsite.commands import DatabaseCommand
from search import analysis
from search.embedders import embedder_languages
from search.ingest.reanalysis import collection_reanalyze
from search.models import Collection


class Command(DatabaseCommand):
    help = (
        "Analyse the chunks of the given collections (default: all) again for keyword search, in their language "
        "or the one given; texts and embeddings are kept."
    )

    def add_arguments(self, parser):
        parser.add_argument("collection_ids", nargs="*", type=int)
        parser.add_argument(
            "--language",
            choices=analysis.LANGUAGES,
            help="Make this the collections' language first: auto (each chunk its own), ja or en.",
        )

    def handle(self, *args, collection_ids, language, **options):
        collections = Collection.objects.order_by("pk")
        if collection_ids:
            collections = collections.filter(pk__in=collection_ids)
            missing = set(collection_ids) - set(collections.values_list("pk", flat=True))
            if missing:
                raise CommandError(f"no collection with id {', '.join(map(str, sorted(missing)))}")
        for collection in list(collections):
            with tqdm(unit="chunk", desc=collection.name, disable=None) as bar:

                def progress(done: int, total: int) -> None:
                    bar.total = total
                    bar.update(done - bar.n)

                collection = collection_reanalyze(collection_id=collection.pk, language=language, on_progress=progress)
            self.stdout.write(
                f"{collection}: language {collection.language}, {collection.chunk_count} chunks analysed again"
            )
            if collection.language != analysis.AUTO and collection.language not in embedder_languages(
                collection.embedding_model
            ):
                self.stdout.write(
                    f"  {collection.embedding_model} does not read {collection.language}: dense search will not rank "
                    f"it well; manage.py reembed {collection.pk} --model <one that does> moves it"
                )
