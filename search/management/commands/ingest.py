"""``manage.py ingest PATH...``: load files, folders or BEIR corpora into a collection."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import CommandError
from django.db.models import Count
from tqdm import tqdm

from ragsite.audit import Action, audit_record
from ragsite.commands import DatabaseCommand
from search import bulk_load as bulk
from search.access import EVERYONE, AccessError, readers_for
from search.beir import is_beir_dir
from search.embedders import DEFAULT_EMBEDDER
from search.models import Document
from search.services import collection_create, workspace_create
from search.tasks import document_ingest


class Command(DatabaseCommand):
    help = "Ingest files, folders and BEIR-layout corpora (corpus.jsonl) into a collection, with a progress bar."

    def add_arguments(self, parser):
        parser.add_argument("paths", nargs="+", type=Path)
        parser.add_argument("--workspace", default="demo", help="Workspace slug (created if missing).")
        parser.add_argument("--collection", default="Documents", help="Collection name (created if missing).")
        parser.add_argument("--model", default=DEFAULT_EMBEDDER, help="Embedding model for a new collection.")
        parser.add_argument(
            "--language",
            default="search_english",
            help="Text-search configuration for a new collection (search_english, german, simple ...).",
        )
        parser.add_argument(
            "--queue", action="store_true", help="Enqueue on the ingest queue instead of ingesting in this process."
        )
        parser.add_argument(
            "--reader-user",
            action="append",
            default=[],
            metavar="USERNAME",
            help="Only this user (and any other --reader-user or --reader-group) may read the new documents.",
        )
        parser.add_argument(
            "--reader-group",
            action="append",
            default=[],
            metavar="GROUP",
            help="Only this group's members (and other named readers) may read the new documents.",
        )

    def handle(self, *args, paths, workspace, collection, model, language, queue, reader_user, reader_group, **options):
        try:
            readers = readers_for(users=reader_user, groups=reader_group)
        except AccessError as exc:
            raise CommandError(exc.message) from None
        ws = workspace_create(name=workspace.title(), slug=workspace)
        target = collection_create(workspace=ws, name=collection, embedding_model=model, text_search_config=language)
        new_ids: list[int] = []
        refused: list[str] = []
        for path in paths:
            if path.is_dir() and is_beir_dir(path):
                ids, rejected = bulk.beir_store(target, path, readers=readers)
                new_ids += ids
                refused += rejected
            else:
                try:
                    ids, rejected = bulk.files_store(target, bulk.files_under([path]), readers=readers)
                except FileNotFoundError as exc:
                    raise CommandError(str(exc)) from None
                new_ids += ids
                refused += rejected
        for reason in refused:
            self.stderr.write(f"refused: {reason}")
        if readers != [EVERYONE] and new_ids:
            audit_record(
                Action.READERS_CHANGE,
                actor="operator",
                workspace_id=ws.pk,
                target=f"collection:{target.pk}",
                detail={"documents": new_ids[:1000], "after": readers, "by": "manage.py ingest"},
            )
        todo = bulk.pending(target)
        self.stdout.write(f"{len(new_ids)} new documents; {len(todo)} to ingest into {ws.slug}/{target.name}")
        if queue:
            for pk in todo:
                document_ingest.delay(pk)
            self.stdout.write(f"queued {len(todo)} documents on the ingest queue")
            return
        with tqdm(total=len(todo), unit="doc", desc="ingest", disable=not todo) as bar:
            bulk.ingest_in_batches(todo, on_documents_done=bar.update)
        counts = dict(
            Document.objects.filter(collection=target).values_list("status").annotate(n=Count("pk")).order_by()
        )
        self.stdout.write(f"collection {target.name}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        for document in Document.objects.filter(collection=target, status=Document.Status.FAILED, pk__in=todo):
            self.stderr.write(f"failed: {document.source_name}: {document.error}")
