"""The browser UI's views through Django's test client: logins, workspaces and isolation,
search, asking, answers, passages and documents. The streamed answer over a real server
is in test_stream.py, the whole UI in a browser in test_browser.py."""

from __future__ import annotations

import re
import uuid

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from search.models import Answer, Chunk, Document
from tests.frontdoors.ui.conftest import ACME_DOCUMENTS, PASSWORD
from tests.search.files import ingest_texts as ingest

HTMX = {"HTTP_HX_REQUEST": "true"}


def chunk_of(workspace) -> Chunk:
    return Chunk.objects.filter(collection__workspace=workspace).order_by("pk").first()


def answer_in(workspace, user, question="How long does the battery last?", **fields) -> Answer:
    chunk = chunk_of(workspace)
    source = {"number": 1, "chunk_id": chunk.pk, "document_id": chunk.document_id, "title": chunk.document.title}
    return Answer.objects.create(
        workspace=workspace, asker=user, question=question, sources=[{**source, "score": 1.0}], **fields
    )


# --------------------------------------------------------------------------- logins and workspaces


def test_every_page_needs_a_login(client, tenants):
    answer = answer_in(tenants.acme, tenants.ann)
    document = Document.objects.filter(collection=tenants.handbook).first()
    pages = [
        reverse("ui:search"),
        reverse("ui:answers"),
        reverse("ui:answer", args=[answer.pk]),
        reverse("ui:passage", args=[chunk_of(tenants.acme).pk]),
        reverse("ui:documents"),
        reverse("ui:document_list"),
        reverse("ui:document_file", args=[document.pk]),
    ]
    for url in pages:
        response = client.get(url)
        assert response.status_code == 302 and response["Location"] == f"/accounts/login/?next={url}", url
    for url in [
        reverse("ui:ask"),
        reverse("ui:upload"),
        reverse("ui:document_retry", args=[document.pk]),
        reverse("ui:document_delete", args=[document.pk]),
        reverse("ui:workspace"),
    ]:
        assert client.post(url)["Location"].startswith("/accounts/login/"), url
    # The event stream cannot be redirected (EventSource would not follow): refused.
    assert client.get(reverse("ui:answer_events", args=[answer.pk])).status_code == 403
    # A fragment asked for by a page whose session ended reloads that page as the login form.
    fragment = client.get(reverse("ui:document_list"), HTTP_HX_CURRENT_URL="http://testserver/documents/", **HTMX)
    assert fragment["HX-Redirect"] == "/accounts/login/?next=/documents/"
    assert Document.objects.filter(pk=document.pk).exists()


def test_log_in_lands_on_the_search_page_and_log_out_returns_to_the_login(client, tenants):
    page = client.get("/accounts/login/?next=/documents/")
    assert page.status_code == 200
    assert re.search(r'<label for="id_username">Username</label>', page.content.decode())
    wrong = client.post("/accounts/login/", {"username": "ann", "password": "nope"})
    assert wrong.status_code == 200 and 'role="alert"' in wrong.content.decode()
    response = client.post("/accounts/login/", {"username": "ann", "password": PASSWORD, "next": "/documents/"})
    assert response["Location"] == "/documents/"
    home = client.get("/")
    assert home.status_code == 200 and "Search Acme" in home.content.decode()
    logout = client.post("/accounts/logout/")
    assert logout["Location"] == "/accounts/login/"
    assert client.get("/").status_code == 302


def test_a_user_without_a_workspace_is_told_so(client, tenants):
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.create_user("dave"))
    response = client.get("/")
    assert response.status_code == 403
    assert "You are not in any workspace yet" in response.content.decode()


def test_a_member_of_several_workspaces_switches_between_them_in_the_session(client, tenants):
    client.force_login(tenants.carol)
    page = client.get("/").content.decode()
    assert 'id="workspace-select"' in page and "Search Acme" in page
    response = client.post(reverse("ui:workspace"), {"workspace": "globex", "next": "/documents/"})
    assert response["Location"] == "/documents/"
    assert "Documents in Globex" in client.get("/documents/").content.decode()
    assert "Globex plans" in client.get("/", {"q": "battery charging"}).content.decode()
    # Never a workspace one is not a member of, never a redirect off the site.
    client.force_login(tenants.ann)
    assert "workspace-select" not in client.get("/").content.decode()
    assert client.post(reverse("ui:workspace"), {"workspace": "globex"}).status_code == 404
    off_site = client.post(reverse("ui:workspace"), {"workspace": "acme", "next": "https://evil.example/"})
    assert off_site["Location"] == "/"


# --------------------------------------------------------------------------- search


def test_search_shows_escaped_snippets_with_highlights_and_links_to_passages(client, tenants):
    client.force_login(tenants.ann)
    page = client.get("/", {"q": "robot battery charge", "mode": "keyword"}).content.decode()
    assert "result" in page and "Keyword (BM25)" in page
    assert "<mark>battery</mark>" in page
    # Document text is never markup: only the highlight marks are (ts_headline drops the
    # tags themselves; what is left is escaped).
    assert "alert(&#x27;robot&#x27;)" in page and "<script>alert" not in page
    robot = Chunk.objects.get(document__source_name="robot.md")
    assert f'href="/passages/{robot.pk}/"' in page
    passage = client.get(f"/passages/{robot.pk}/").content.decode()
    assert "&lt;script&gt;alert(&#x27;robot&#x27;)&lt;/script&gt;" in passage and "<script>alert" not in passage
    for mode in ("hybrid", "dense"):
        assert f'href="/passages/{robot.pk}/"' in client.get("/", {"q": "robot battery", "mode": mode}).content.decode()


def test_a_sentence_in_the_search_box_is_read_as_a_question_and_says_so(client, tenants):
    client.force_login(tenants.ann)
    typed = client.get("/", {"q": '"propeller slipstream" battery', "mode": "keyword"}).content.decode()
    assert "1 result for" in typed and "Wing aerodynamics" in typed and "read-as-question" not in typed
    asked = client.get("/", {"q": 'Does the "propeller slipstream" drain the battery?', "mode": "keyword"})
    page = asked.content.decode()
    assert "2 results for" in page and "Wing aerodynamics" in page and "Atlas-7 robot" in page
    assert 'id="read-as-question"' in page and "its quotation marks do not filter" in page


def test_search_sees_only_the_current_workspace_and_its_collections(client, tenants):
    client.force_login(tenants.ann)
    page = client.get("/", {"q": "Globex battery charging", "mode": "keyword"}).content.decode()
    assert "secret" not in page and "Globex plans" not in page
    # A collection of another workspace is not a choice.
    refused = client.get("/", {"q": "battery", "collection": tenants.plans.pk}).content.decode()
    assert "Select a valid choice" in refused and "Globex plans" not in refused
    # The chosen collection filters.
    manuals_only = client.get("/", {"q": "battery", "collection": tenants.manuals.pk}).content.decode()
    assert "0 results" in manuals_only


# --------------------------------------------------------------------------- asking and answers


def test_ask_starts_an_extractive_answer_and_returns_the_streaming_panel(client, tenants):
    client.force_login(tenants.ann)
    response = client.post(reverse("ui:ask"), {"q": "How long does the robot battery last?"}, **HTMX)
    assert response.status_code == 200
    answer = Answer.objects.get()
    assert (answer.asker, answer.workspace, answer.mode) == (tenants.ann, tenants.acme, Answer.Mode.EXTRACTIVE)
    panel = response.content.decode()
    assert f'data-answer-stream="/answers/{answer.pk}/events/"' in panel
    assert "Extractive answer" in panel and 'aria-live="polite"' in panel
    assert f'"url": "/passages/{answer.sources[0]["chunk_id"]}/"' in panel  # the sources, for ui.js
    # Without htmx, the answer's own page.
    plain = client.post(reverse("ui:ask"), {"q": "How long does charging take?", "collection": tenants.handbook.pk})
    assert plain["Location"] == f"/answers/{Answer.objects.first().pk}/"


def test_ask_refuses_an_empty_question_or_another_workspaces_collection(client, tenants):
    client.force_login(tenants.ann)
    empty = client.post(reverse("ui:ask"), {"q": "  "}, **HTMX)
    assert empty.status_code == 422 and "the question is empty" in empty.content.decode()
    theirs = client.post(reverse("ui:ask"), {"q": "battery?", "collection": tenants.plans.pk}, **HTMX)
    assert theirs.status_code == 422 and "Select a valid choice" in theirs.content.decode()
    assert Answer.objects.count() == 0


def test_a_stored_answer_links_its_citations_and_escapes_its_text(client, tenants):
    answer = answer_in(
        tenants.acme,
        tenants.ann,
        status=Answer.Status.DONE,
        text="It lasts <b>10 hours</b> [1]. Unknown [9].",
    )
    chunk_id = answer.sources[0]["chunk_id"]
    answer.citations = [{"number": 1, "chunk_id": chunk_id}]
    answer.save()
    client.force_login(tenants.ann)
    page = client.get(reverse("ui:answer", args=[answer.pk])).content.decode()
    assert "It lasts &lt;b&gt;10 hours&lt;/b&gt; [" in page
    assert re.search(rf'\[<a class="cite" href="/passages/{chunk_id}/" data-passage [^>]*>1</a>\]', page)
    assert "Unknown [9]." in page  # a number the answer was not given stays text
    assert "data-answer-stream" not in page and "Done." in page
    # Still generating: the page follows the stream.
    pending = answer_in(tenants.acme, tenants.ann, status=Answer.Status.GENERATING)
    assert "data-answer-stream" in client.get(reverse("ui:answer", args=[pending.pk])).content.decode()


def test_an_extractive_answer_says_why_it_quotes(client, tenants):
    """The badge gives the answer's own reason: no model, or a model whose answer nothing
    supported (quoted instead), never "no model" for an answer a model generated."""
    client.force_login(tenants.ann)
    reasons = {
        "": "no generation model is configured",
        "the generation model is still starting": "the generation model is still starting",
    }
    for why, shown in reasons.items():
        answer = answer_in(tenants.acme, tenants.ann, status=Answer.Status.DONE, mode=Answer.Mode.EXTRACTIVE)
        answer.stats = {"why": why} if why else {}
        answer.save()
        page = client.get(reverse("ui:answer", args=[answer.pk])).content.decode()
        assert f"sentences quoted from the sources, because {shown}." in page
    quoted = answer_in(tenants.acme, tenants.ann, status=Answer.Status.DONE, mode=Answer.Mode.EXTRACTIVE)
    quoted.stats = {"quoted_instead": {"why": "nothing in the model's answer was supported by its sources"}}
    quoted.save()
    page = client.get(reverse("ui:answer", args=[quoted.pk])).content.decode()
    assert "because nothing in the model&#x27;s answer was supported by its sources." in page
    assert "no generation model is configured" not in page


def test_the_conversations_listed_are_the_users_own_latest_first(client, tenants):
    older = answer_in(tenants.acme, tenants.ann, question="First question?")
    newer = answer_in(tenants.acme, tenants.ann, question="Second question?")
    answer_in(tenants.acme, tenants.carol, question="Carol's question?")
    client.force_login(tenants.ann)
    page = client.get(reverse("ui:answers")).content.decode()
    assert page.index(f"/answers/{newer.pk}/") < page.index(f"/answers/{older.pk}/")
    assert "Carol" not in page
    assert "Second question?" in client.get("/").content.decode()  # also on the search page


# --------------------------------------------------------------------------- isolation


def test_another_workspaces_answers_passages_and_documents_are_not_found(client, tenants):
    theirs = answer_in(tenants.globex, tenants.bob)
    their_chunk = chunk_of(tenants.globex)
    their_document = their_chunk.document
    client.force_login(tenants.ann)
    assert client.get(reverse("ui:answer", args=[theirs.pk])).status_code == 404
    assert client.get(reverse("ui:answer", args=[uuid.uuid4()])).status_code == 404
    assert client.get(reverse("ui:answer_events", args=[theirs.pk])).status_code == 404
    assert client.get(reverse("ui:passage", args=[their_chunk.pk])).status_code == 404
    assert client.post(reverse("ui:document_retry", args=[their_document.pk])).status_code == 404
    assert client.post(reverse("ui:document_delete", args=[their_document.pk])).status_code == 404
    assert client.get(reverse("ui:document_file", args=[their_document.pk])).status_code == 404
    assert Document.objects.filter(pk=their_document.pk).exists()
    assert "secret" not in client.get(reverse("ui:documents")).content.decode()
    # A member of both sees both.
    client.force_login(tenants.carol)
    assert client.get(reverse("ui:answer", args=[theirs.pk])).status_code == 200
    assert client.get(reverse("ui:passage", args=[their_chunk.pk])).status_code == 200


# --------------------------------------------------------------------------- passages


def test_a_passage_is_shown_highlighted_in_the_text_around_it(client, tenants):
    text = " ".join(f"Sentence {index} tells about the wing and its flaps." for index in range(400))
    [document_id] = ingest(tenants.manuals, {"long.txt": text})
    chunks = list(Chunk.objects.filter(document_id=document_id).order_by("ordinal"))
    assert len(chunks) >= 3
    middle = chunks[1]
    client.force_login(tenants.ann)
    page = client.get(reverse("ui:passage", args=[middle.pk])).content.decode()
    marked = re.search(r'<div class="passage-text">(.*?)<mark class="passage-hit">(.*?)</mark>(.*?)</div>', page, re.S)
    before, hit, after = marked.groups()
    assert hit == middle.text
    assert text[: middle.start_offset].endswith(before) and before
    assert text[middle.end_offset :].startswith(after) and after
    assert f"passage 2 of {len(chunks)}" in page
    assert f'href="/passages/{chunks[0].pk}/" rel="prev"' in page and f'href="/passages/{chunks[2].pk}/"' in page
    # The citation dialog asks for the passage alone.
    fragment = client.get(reverse("ui:passage", args=[middle.pk]), **HTMX).content.decode()
    assert fragment.lstrip().startswith("<article") and "<html" not in fragment


# --------------------------------------------------------------------------- documents


def test_uploading_several_files_reports_each_and_lists_them_in_progress(client, tenants):
    client.force_login(tenants.ann)

    def files(*extra):
        return [
            SimpleUploadedFile("notes.md", b"# Notes\n\nReceipts are due within 30 days."),
            SimpleUploadedFile("wing.md", ACME_DOCUMENTS["wing.md"].encode()),  # the same bytes as an indexed document
            *extra,
        ]

    # All or nothing, as in the API: one refused file stores none, and the report names it.
    refused = client.post(
        reverse("ui:upload"),
        {"collection": tenants.handbook.pk, "files": files(SimpleUploadedFile("empty.txt", b""))},
        **HTMX,
    )
    report = refused.content.decode()
    assert refused.status_code == 422
    assert "empty.txt: the file is empty" in report and "Nothing was stored" in report
    assert not Document.objects.filter(source_name="notes.md").exists()

    response = client.post(reverse("ui:upload"), {"collection": tenants.handbook.pk, "files": files()}, **HTMX)
    report = response.content.decode()
    assert response.status_code == 200
    assert "notes.md: queued for indexing in Handbook." in report
    assert "wing.md: already in Handbook as “Wing aerodynamics”." in report
    # The documents table comes along out of band, polling while a document is queued.
    assert 'id="document-list"' in report and 'hx-swap-oob="true"' in report and 'hx-trigger="every 1s"' in report
    notes = Document.objects.get(source_name="notes.md")
    assert notes.status == Document.Status.QUEUED and notes.collection == tenants.handbook
    # Without htmx: messages on the documents page.
    plain = client.post(
        reverse("ui:upload"),
        {"collection": tenants.handbook.pk, "files": [SimpleUploadedFile("b.txt", b"Bees make honey.")]},
        follow=True,
    )
    assert "b.txt: queued for indexing in Handbook." in plain.content.decode()
    # Another workspace's collection is no choice.
    theirs = client.post(
        reverse("ui:upload"), {"collection": tenants.plans.pk, "files": [SimpleUploadedFile("x.txt", b"x")]}, **HTMX
    )
    assert theirs.status_code == 422 and not Document.objects.filter(source_name="x.txt").exists()


def test_the_document_list_polls_only_while_a_document_is_in_progress(client, tenants):
    client.force_login(tenants.ann)
    settled = client.get(reverse("ui:document_list"), **HTMX).content.decode()
    assert "hx-trigger" not in settled and "2 documents: 2 indexed, 0 in progress, 0 failed." in settled
    document = Document.objects.get(source_name="robot.md")
    Document.objects.filter(pk=document.pk).update(status=Document.Status.EMBEDDING, chunks_total=8, chunks_embedded=3)
    busy = client.get(reverse("ui:document_list"), **HTMX).content.decode()
    assert 'hx-trigger="every 1s"' in busy
    assert '<progress max="8" value="3"' in busy and "3 of 8 passages" in busy
    assert "1 in progress" in busy


def test_a_failed_document_shows_why_and_can_be_retried_or_deleted(client, tenants):
    document = Document.objects.get(source_name="robot.md")
    Document.objects.filter(pk=document.pk).update(status=Document.Status.FAILED, error="the PDF is encrypted")
    client.force_login(tenants.ann)
    page = client.get(reverse("ui:documents")).content.decode()
    assert "the PDF is encrypted" in page and f'id="retry-{document.pk}"' in page
    assert client.get(reverse("ui:document_retry", args=[document.pk])).status_code == 405
    retried = client.post(reverse("ui:document_retry", args=[document.pk]), {"page": "1"}, **HTMX)
    assert retried.status_code == 200 and "is queued again" in retried.content.decode()
    document.refresh_from_db()
    assert (document.status, document.error) == (Document.Status.QUEUED, "")
    deleted = client.post(reverse("ui:document_delete", args=[document.pk]), follow=True)
    assert "“Atlas-7 robot” deleted." in deleted.content.decode()
    assert not Document.objects.filter(pk=document.pk).exists()
    assert not Chunk.objects.filter(document_id=document.pk).exists()


@pytest.mark.parametrize("path", ["/static/search/ui.js", "/static/search/ui.css", "/static/django_htmx/htmx-2.min.js"])
def test_the_front_end_is_served_from_our_own_static_files(client, path):
    response = client.get(path)
    assert response.status_code == 200, path


def test_a_superuser_without_memberships_sees_every_workspace(client, db):
    from django.contrib.auth import get_user_model

    from search.models import Workspace

    first = Workspace.objects.create(name="Demo", slug="demo-superuser")
    Workspace.objects.create(name="Zeta", slug="zeta-superuser")
    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw-for-tests")
    client.force_login(admin)

    page = client.get("/")

    assert page.status_code == 200
    assert {w.slug for w in page.context["request"].workspaces} >= {first.slug, "zeta-superuser"}


# --------------------------------------------------------------------------- conversations


def test_a_follow_up_continues_the_thread_which_survives_a_reload_and_is_listed(client, tenants):
    from search.models import Conversation
    from tests.search.answering.test_conversations import FIRST, FOLLOW_UP, FOLLOW_UP_QUERY, TRAVEL

    ingest(tenants.manuals, TRAVEL)
    client.force_login(tenants.ann)
    manuals = tenants.manuals.pk
    asked = client.post(reverse("ui:ask"), {"q": FIRST, "collection": manuals})
    first = Answer.objects.get(question=FIRST)
    assert asked["Location"] == reverse("ui:answer", args=[first.pk])
    page = client.get(asked["Location"]).content.decode()
    # Under the answer, a box for the next question of this conversation.
    assert f'name="conversation" value="{first.conversation_id}"' in page and 'action="/ask/"' in page

    followed = client.post(
        reverse("ui:ask"), {"q": FOLLOW_UP, "collection": manuals, "conversation": first.conversation_id}
    )
    follow = Answer.objects.get(question=FOLLOW_UP)
    assert followed["Location"] == reverse("ui:answer", args=[follow.pk])
    assert follow.conversation_id == first.conversation_id
    assert follow.retrieval_query == FOLLOW_UP_QUERY
    # The thread, from the database (a reload shows the same): both turns in order, the
    # follow-up's search shown, its answer quoting the per-diem passage.
    page = client.get(followed["Location"]).content.decode()
    assert page.index(f'id="turn-{first.pk}"') < page.index(f'id="turn-{follow.pk}"')
    assert f'id="turn-{follow.pk}" aria-current="true"' in page
    assert f"Searched for:</span> {follow.retrieval_query}" in page
    assert "EUR 90 a day in Berlin" in page

    def without_tokens(html: str) -> str:
        return re.sub(r'name="csrfmiddlewaretoken" value="[^"]+"', "", html)

    assert without_tokens(client.get(followed["Location"]).content.decode()) == without_tokens(page)
    listed = client.get(reverse("ui:answers")).content.decode()
    assert listed.count(f'href="/answers/{follow.pk}/"') == 1 and f"/answers/{first.pk}/" not in listed
    assert f"{FIRST}</a>" in listed and "2 questions" in listed
    assert Conversation.objects.filter(workspace=tenants.acme).count() == 1


def test_a_conversation_is_renamed_and_deleted_by_its_owner_only(client, tenants):
    from search.models import Conversation

    answer = answer_in(tenants.acme, tenants.ann, question="First question?")
    conversation = answer.conversation
    client.force_login(tenants.carol)  # a member of the workspace, not the conversation's owner
    page = client.get(reverse("ui:answer", args=[answer.pk])).content.decode()
    assert 'name="conversation"' not in page and "Rename or delete" not in page
    assert client.post(reverse("ui:conversation_rename", args=[conversation.pk]), {"title": "Mine"}).status_code == 404
    assert client.post(reverse("ui:conversation_delete", args=[conversation.pk])).status_code == 404
    refused = client.post(reverse("ui:ask"), {"q": "And then?", "conversation": conversation.pk})
    assert refused.status_code == 302 and not Answer.objects.filter(question="And then?").exists()

    client.force_login(tenants.ann)
    renamed = client.post(reverse("ui:conversation_rename", args=[conversation.pk]), {"title": "  Battery  life "})
    assert renamed["Location"] == reverse("ui:answer", args=[answer.pk])
    assert Conversation.objects.get(pk=conversation.pk).title == "Battery life"
    assert "<h1>Battery life</h1>" in client.get(renamed["Location"]).content.decode()
    deleted = client.post(reverse("ui:conversation_delete", args=[conversation.pk]))
    assert deleted["Location"] == reverse("ui:answers")
    assert not Conversation.objects.filter(pk=conversation.pk).exists()
    assert not Answer.objects.filter(pk=answer.pk).exists()


def test_a_document_is_downloaded_as_uploaded_under_its_japanese_name(client, tenants):
    from search.services import document_create

    content = "出張の日当は3,000円です。\n".encode("cp932")
    document, _ = document_create(
        collection=tenants.handbook, source_name="経費精算規程.txt", content=content, enqueue=False
    )
    client.force_login(tenants.ann)
    listing = client.get(reverse("ui:documents")).content.decode()
    link = reverse("ui:document_file", args=[document.pk])
    assert f'<a class="meta" href="{link}" download title="Download the original file">経費精算規程.txt</a>' in listing
    response = client.get(link)
    assert response.status_code == 200
    assert response["Content-Type"] == "application/octet-stream"
    assert response["Content-Disposition"] == (
        "attachment; filename*=utf-8''%E7%B5%8C%E8%B2%BB%E7%B2%BE%E7%AE%97%E8%A6%8F%E7%A8%8B.txt"
    )
    assert b"".join(response.streaming_content) == content
    document.file.delete(save=False)
    assert client.get(link).status_code == 404
