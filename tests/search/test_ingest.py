"""The ingestion pipeline against real PostgreSQL + pgvector, with the real embedder."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from django.db import DataError, connection

from billing import ledger
from billing.models import UsageRecord
from ragsite.redis import Role, redis_client
from search.ingest import chunk_writes, pipeline
from search.ingest.parsers import parse_document
from search.models import Chunk, Collection, Document, TermStat
from search.services import DocumentRejected, document_create, document_delete, document_retry
from tests.search.files import SAMPLE_PDF, encrypt_pdf, seeded_bytes

HANDBOOK = (
    "# Expenses\n\n"
    "Receipts must be submitted within 30 days of the trip. Claims above 500 EUR need a manager's approval.\n\n"
    "## Per diems\n\n"
    "Meals abroad are covered by a per-diem of 45 EUR per day in Germany and 60 EUR in Switzerland.\n"
)


def ingest(collection, name: str, content: bytes | str) -> Document:
    data = content.encode() if isinstance(content, str) else content
    document, _ = document_create(collection=collection, source_name=name, content=data, enqueue=False)
    return pipeline.document_ingest(document_id=document.pk)


def term_stats(collection) -> dict[int, int]:
    return dict(TermStat.objects.filter(collection=collection).values_list("term", "df"))


def recomputed_term_stats(collection) -> dict[int, int]:
    """Document frequencies computed from scratch from the stored chunks."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT search_term_index(u.lexeme), count(DISTINCT c.id) FROM search_chunk c, unnest(c.tsv) u"
            " WHERE c.collection_id = %s AND search_bm25_lexeme(u.lexeme) GROUP BY 1",
            [collection.pk],
        )
        return dict(cursor.fetchall())


def test_a_document_is_parsed_chunked_embedded_and_indexed(collection):
    document = ingest(collection, "handbook.md", HANDBOOK)

    assert document.status == Document.Status.INDEXED
    assert document.error == ""
    assert document.title == "Expenses"  # from the Markdown heading, not the file name
    assert document.media_type == "text/markdown"
    assert document.attempts == 1
    text = parse_document(HANDBOOK.encode(), media_type="text/markdown").text
    chunks = list(Chunk.objects.filter(document=document).order_by("ordinal"))
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    assert document.chunks_total == document.chunks_embedded == len(chunks) >= 1
    for chunk in chunks:
        assert chunk.text == text[chunk.start_offset : chunk.end_offset]
        assert chunk.embedding_model == "all-MiniLM-L6-v2"
        assert chunk.embedding_dimensions == 384
        vector = np.asarray(chunk.embedding)
        assert vector.shape == (384,)
        assert math.isclose(float(np.linalg.norm(vector)), 1.0, rel_tol=1e-3)
    assert chunks[0].text.startswith("Expenses")
    collection.refresh_from_db()
    assert collection.chunk_count == len(chunks)
    assert term_stats(collection) == recomputed_term_stats(collection)


def test_the_same_file_twice_is_one_document(collection):
    first = ingest(collection, "handbook.md", HANDBOOK)
    stats = term_stats(collection)
    again, created = document_create(collection=collection, source_name="copy.md", content=HANDBOOK.encode())
    assert (again.pk, created) == (first.pk, False)
    # A redelivered task for an indexed document changes nothing.
    assert pipeline.document_ingest(document_id=first.pk).status == Document.Status.INDEXED
    assert Chunk.objects.filter(document=first).count() == first.chunks_total
    assert term_stats(collection) == stats
    assert Document.objects.filter(collection=collection).count() == 1


def test_the_same_text_in_another_file_is_refused_as_a_duplicate(collection):
    first = ingest(collection, "handbook.md", HANDBOOK)
    second = ingest(collection, "handbook-copy.md", HANDBOOK + "\n\n")  # other bytes, same normalised text
    assert second.status == Document.Status.FAILED
    assert second.error == f"same text as document {first.pk} (Expenses) in this collection"
    assert Chunk.objects.filter(document=second).count() == 0


def test_a_failed_write_leaves_no_chunk_behind(collection):
    document, _ = document_create(collection=collection, source_name="h.md", content=HANDBOOK.encode(), enqueue=False)
    parsed = parse_document(HANDBOOK.encode(), media_type="text/markdown")
    prepared = pipeline._prepare(document, parsed, "0" * 64)
    vectors = np.ones((len(prepared.chunks), 384), dtype=np.float32) / math.sqrt(384)
    vectors[-1, 0] = np.nan  # pgvector refuses NaN: the COPY fails on the last row
    with pytest.raises(DataError):
        chunk_writes.chunks_write(
            document=document,
            chunks=prepared.chunks,
            vectors=vectors,
            embedder=prepared.embedder,
            text_sha256=prepared.text_sha256,
            title=prepared.title,
            metadata={},
        )
    assert Chunk.objects.filter(document=document).count() == 0
    assert TermStat.objects.filter(collection=collection).count() == 0
    assert Collection.objects.get(pk=collection.pk).chunk_count == 0
    assert Document.objects.get(pk=document.pk).status == Document.Status.QUEUED


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("empty.txt", b"", "empty.txt: the file is empty"),
        ("noise.bin", seeded_bytes(7, 4096), "noise.bin: unsupported file type"),
        ("report.pdf", b"Just some text, not a PDF.", "report.pdf: report.pdf is named .pdf but its content"),
    ],
)
def test_bad_uploads_are_refused_with_the_reason(collection, name, content, reason):
    with pytest.raises(DocumentRejected) as excinfo:
        document_create(collection=collection, source_name=name, content=content, enqueue=False)
    assert str(excinfo.value).startswith(reason)
    assert Document.objects.filter(collection=collection).count() == 0


def test_an_upload_over_the_limit_is_refused(collection, settings):
    settings.DOCUMENT_MAX_BYTES = 100
    with pytest.raises(DocumentRejected) as excinfo:
        document_create(collection=collection, source_name="big.txt", content=b"word " * 30, enqueue=False)
    assert str(excinfo.value) == "big.txt is 150 bytes, over the limit of 100 bytes"


def test_unreadable_documents_fail_with_a_reason_and_others_are_untouched(collection):
    good, _ = document_create(collection=collection, source_name="good.md", content=HANDBOOK.encode(), enqueue=False)
    locked, _ = document_create(
        collection=collection,
        source_name="locked.pdf",
        content=encrypt_pdf(SAMPLE_PDF, user_password="secret"),
        enqueue=False,
    )
    truncated, _ = document_create(
        collection=collection, source_name="cut.pdf", content=SAMPLE_PDF[: len(SAMPLE_PDF) // 2], enqueue=False
    )
    results = pipeline.documents_ingest(document_ids=[locked.pk, good.pk, truncated.pk])

    assert [d.status for d in results] == ["failed", "indexed", "failed"]
    assert results[0].error == "the PDF is encrypted with a password"
    assert results[2].error.startswith("the PDF could not be read: ")
    assert Chunk.objects.filter(collection=collection).values_list("document_id", flat=True).distinct().get() == good.pk


def test_non_utf8_text_is_decoded_not_mangled(collection):
    document = ingest(collection, "menu.txt", "Café in Zürich: naïve prices, 5 € each.".encode("cp1252"))
    assert document.status == Document.Status.INDEXED
    assert Chunk.objects.get(document=document).text == "Café in Zürich: naïve prices, 5 € each."
    assert document.metadata["encoding"] == "cp1252"


def test_a_failed_document_can_be_retried(collection):
    document, _ = document_create(collection=collection, source_name="h.md", content=HANDBOOK.encode(), enqueue=False)
    stored = document.file.read()
    document.file.storage.delete(document.file.name)
    failed = pipeline.document_ingest(document_id=document.pk)
    assert (failed.status, failed.error) == ("failed", "the uploaded file is missing from storage")

    document.file.storage.save(document.file.name, __import__("io").BytesIO(stored))
    queued = document_retry(document=failed)
    assert (queued.status, queued.error) == ("queued", "")
    indexed = pipeline.document_ingest(document_id=document.pk)
    assert indexed.status == "indexed"
    assert indexed.attempts == 2


def test_a_document_cut_off_three_times_fails_instead_of_being_redelivered_for_ever(collection):
    from search.ingest.pipeline import interruptions_key
    from search.tasks import INGEST_MAX_INTERRUPTIONS, document_ingest

    document, _ = document_create(collection=collection, source_name="h.md", content=HANDBOOK.encode(), enqueue=False)
    in_progress = {"status": Document.Status.EMBEDDING}
    # Each delivery that finds the document still in progress follows a worker that died on it.
    for cut_off in range(1, INGEST_MAX_INTERRUPTIONS):
        Document.objects.filter(pk=document.pk).update(**in_progress)
        assert document_ingest.apply(args=(document.pk,)).get() == "indexed"  # the task, run here
        assert int(redis_client(Role.BROKER).get(interruptions_key(document.pk))) == cut_off
    Document.objects.filter(pk=document.pk).update(**in_progress)
    assert document_ingest.apply(args=(document.pk,)).get() == "failed"
    document.refresh_from_db()
    assert document.error.startswith("ingestion was cut off 3 times: the worker process died while working on this")
    # A retry by a person starts a new count.
    document_retry(document=document)
    assert redis_client(Role.BROKER).get(interruptions_key(document.pk)) is None
    assert pipeline.document_ingest(document_id=document.pk).status == "indexed"


def test_deleting_a_document_removes_its_share_of_the_statistics(collection):
    first = ingest(collection, "handbook.md", HANDBOOK)
    second = ingest(collection, "travel.txt", "Trains are booked in second class. Flights need approval.")
    collection.refresh_from_db()
    assert collection.chunk_count == first.chunks_total + second.chunks_total

    document_delete(document=second)
    collection.refresh_from_db()
    assert collection.chunk_count == first.chunks_total
    assert term_stats(collection) == recomputed_term_stats(collection)
    assert not Document.objects.filter(pk=second.pk).exists()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT sum(coalesce(array_length(u.positions, 1), 1)) FROM search_chunk c, unnest(c.tsv) u"
            " WHERE c.collection_id = %s AND search_bm25_lexeme(u.lexeme)",
            [collection.pk],
        )
        assert collection.lexeme_total == cursor.fetchone()[0]


def test_sql_and_python_split_punctuation_identically(db):
    import string

    from search.text_normalization import punctuation_split

    sample = "high-speed m=2.5 x/c (a,b) " + string.punctuation + " Zürich naïve snake_case \u2018quoted\u2019"
    with connection.cursor() as cursor:
        cursor.execute("SELECT search_text_normalize(%s)", [sample])
        assert cursor.fetchone()[0] == punctuation_split(sample)
    assert punctuation_split("high-speed m=2.5") == "high speed m 2 5"


@pytest.mark.parametrize("config", ["search_english", "english", "simple"])
def test_sql_and_python_prepare_text_identically(db, config):
    """search_tsvector(config, text) is to_tsvector(config, text_prepare(text, config)):
    the stop words of search_english (the same 33 in SQL and Python) leave before parsing."""
    from search.text_normalization import ENGLISH_STOP_WORDS, text_prepare

    sample = (
        "The Atlas-7's THEORY: it is in-flight, not INTO anatomy; its being theirs. A l'été, ça va: "
        + " ".join(ENGLISH_STOP_WORDS).upper()
        + " then thereafter"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT search_tsvector(%s::regconfig, %s)::text, to_tsvector(%s::regconfig, %s)::text",
            [config, sample, config, text_prepare(sample, config)],
        )
        indexed, prepared = cursor.fetchone()
    assert indexed == prepared
    if config == "search_english":
        # Stop words are gone as words; words that merely contain or stem to one stay
        # ("its" -> "it", "being" -> "be", as bm25s and Lucene keep them).
        assert (
            indexed == "'7':2 'anatomi':6 'atlas':1 'be':8 'flight':5 'it':7 'l':10 's':3 'their':9 'theori':4 "
            "'thereaft':14 'va':13 'ça':12 'été':11"
        )


def test_long_documents_are_chunked_to_the_end_after_the_model_has_run(collection):
    from search.embedders import embedder_get

    embedder = embedder_get("all-MiniLM-L6-v2")
    embedder.embed_documents(["the model runs first, as it does in a busy worker"])
    text = " ".join(f"Sentence number {i} talks about wing flutter and heat transfer." for i in range(400))
    offsets = embedder.token_offsets(text)
    assert offsets[-1][1] == len(text)  # no truncation to the model's window
    document = ingest(collection, "long.txt", text)
    chunks = list(Chunk.objects.filter(document=document).order_by("ordinal"))
    assert chunks[0].start_offset == 0
    assert chunks[-1].end_offset == len(text)
    for previous, current in itertools.pairwise(chunks):
        assert current.start_offset <= previous.end_offset  # no gap between chunks
    assert all(chunk.token_count <= embedder.max_tokens for chunk in chunks)


@pytest.mark.django_db(transaction=True)
def test_bulk_ingestion_overlaps_writes_with_embedding_and_loses_nothing(monkeypatch, settings, tmp_path):
    from search import bulk_load as bulk
    from search.services import collection_create, workspace_create

    settings.MEDIA_ROOT = tmp_path / "bulk-media"
    collection = collection_create(workspace=workspace_create(name="Bulk", slug="bulk"), name="Bulk")
    monkeypatch.setattr(bulk, "BATCH_DOCUMENTS", 2)  # 5 documents: 3 batches, 2 writes overlapped
    texts = [f"Document {i} is about {word} and nothing else." for i, word in enumerate("abcde")]
    texts.append(texts[0] + "\n")  # same text as the first, in a later batch: refused as a duplicate
    ids = []
    for index, text in enumerate(texts):
        document, _ = document_create(
            collection=collection, source_name=f"d{index}.txt", content=text.encode(), enqueue=False
        )
        ids.append(document.pk)
    done = []
    bulk.ingest_in_batches(ids, on_documents_done=done.append)

    assert done == [2, 2, 2]
    statuses = dict(Document.objects.filter(pk__in=ids).values_list("pk", "status"))
    assert [statuses[pk] for pk in ids] == ["indexed"] * 5 + ["failed"]
    assert Document.objects.get(pk=ids[-1]).error.startswith("same text as")
    assert Chunk.objects.filter(collection=collection).count() == 5
    assert term_stats(collection) == recomputed_term_stats(collection)
    collection.refresh_from_db()
    assert collection.chunk_count == 5


def test_embedding_calls_are_on_the_ledger_one_row_per_document(collection):
    redis_client(Role.STREAMS).delete(ledger.OUTBOX)  # rows other tests left are not this database's
    handbook = ingest(collection, "handbook.md", HANDBOOK)
    other = ingest(collection, "notes.txt", "Travel insurance covers lost luggage up to 1000 EUR per trip.")

    assert ledger.usage_records_store() == 2

    rows = {row.workspace_id: row for row in UsageRecord.objects.filter(kind=UsageRecord.Kind.EMBEDDING)}
    assert list(rows) == [collection.workspace_id]
    stored = UsageRecord.objects.filter(kind=UsageRecord.Kind.EMBEDDING).order_by("prompt_tokens")
    expected = sorted(
        sum(Chunk.objects.filter(document=document).values_list("token_count", flat=True))
        for document in (handbook, other)
    )
    assert [row.prompt_tokens for row in stored] == expected
    for row in stored:
        assert (row.model, row.status, row.completion_tokens, row.latency_ms > 0) == ("all-MiniLM-L6-v2", "ok", 0, True)
        assert row.cost_usd == 0 and row.price.model == "all-MiniLM-L6-v2"  # priced at 0, explicitly
