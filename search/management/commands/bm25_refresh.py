"""``manage.py bm25_refresh [COLLECTION_ID...]``: recompute stored BM25 weights.

Needed after changing BM25_K1 or BM25_B; ingestion also schedules it by itself when a
collection's average chunk length drifts by more than 20 % from the stored weights'.
"""

from __future__ import annotations

from tqdm import tqdm

from ragsite.commands import DatabaseCommand
from search.bm25 import collection_bm25_refresh
from search.models import Collection


class Command(DatabaseCommand):
    help = "Recompute the BM25 weights of every chunk of the given collections (default: all)."

    def add_arguments(self, parser):
        parser.add_argument("collection_ids", nargs="*", type=int)

    def handle(self, *args, collection_ids, **options):
        collections = Collection.objects.order_by("pk")
        if collection_ids:
            collections = collections.filter(pk__in=collection_ids)
        for collection in tqdm(list(collections), unit="collection", disable=None):
            avgdl = collection_bm25_refresh(collection_id=collection.pk)
            self.stdout.write(f"{collection}: {collection.chunk_count} chunks, average length {avgdl:.1f}")
