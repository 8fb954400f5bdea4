"""Documents only some people may read (search.access): a restricted document is ranked,
listed, quoted, cited and downloaded for its readers only, in every search mode and through
every door, and a change of its readers holds on the next request, conversations included.

Alice is in the group "hr", Bob is not; both are members of the workspace. The salary
document is readable by "hr"; the handbook documents by the whole workspace.
"""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, override_settings
from rest_framework.test import APIClient

from billing import client_keys
from search.access import OPERATOR, WORKSPACE, AccessError, reader_of_user, readers_for
from search.answering.answers import answer_create
from search.answering.conversations import history_of
from search.ingest import pipeline
from search.models import Chunk, Document, Membership
from search.selectors import chunk_search
from search.services import collection_create, document_create, document_readers_set, workspace_create
from tests.search.files import ingest_texts

pytestmark = pytest.mark.django_db

SALARY = "The salary band for senior engineers in Tokyo is 9 to 14 million yen a year."
SALARY_QUESTION = "What is the salary band for senior engineers in Tokyo?"
OPEN = {
    "badges.md": "# Badges\n\nA lost staff badge is replaced at the front desk for 3,000 yen.",
    "travel.md": "# Travel\n\nTrain tickets for business trips are booked through the travel portal.",
    "leave.md": "# Leave\n\nEngineers take 20 days of paid leave a year, booked in the HR portal.",
    "desks.md": "# Desks\n\nHot desks in the Tokyo office are booked a day ahead.",
}


@pytest.fixture
def office(db, settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path / "media"
    workspace = workspace_create(name="Acme", slug="acme")
    collection = collection_create(workspace=workspace, name="Handbook")
    hr = Group.objects.create(name="hr")
    users = get_user_model().objects
    alice, bob = users.create_user("alice", password="pw-alice"), users.create_user("bob", password="pw-bob")
    alice.groups.add(hr)
    for user in (alice, bob):
        Membership.objects.create(workspace=workspace, user=user)
    ingest_texts(collection, OPEN)
    (salary,) = ingest_texts(collection, {"salaries.md": f"# Salaries\n\n{SALARY}"})
    salary = Document.objects.get(pk=salary)
    document_readers_set(document=salary, readers=readers_for(groups=["hr"]))
    return type(
        "Office", (), dict(workspace=workspace, collection=collection, hr=hr, alice=alice, bob=bob, salary=salary)
    )


def chunk_readers(document) -> set[tuple[str, ...]]:
    """The distinct readers its chunks carry (none: no chunk)."""
    return {tuple(readers) for readers in Chunk.objects.filter(document=document).values_list("readers", flat=True)}


def documents_found(office, reader, mode: str, top_k: int = 3, **options) -> list[int]:
    result = chunk_search(
        query=SALARY_QUESTION, workspace=office.workspace, mode=mode, top_k=top_k, reader=reader, **options
    )
    return [hit.document_id for hit in result.hits]


# Few readable chunks: ranked exactly through their documents; a limit of 0: the rankings' own scans, filtered.
PATHS = {"through_documents": 5000, "filtered_scan": 0}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
def test_a_restricted_document_is_ranked_for_its_readers_only_in_every_mode(office, mode, path):
    with override_settings(SEARCH_EXACT_READABLE_MAX_CHUNKS=PATHS[path]):
        alice = documents_found(office, reader_of_user(office.alice), mode)
        bob = documents_found(office, reader_of_user(office.bob), mode)
        workspace_key = documents_found(office, WORKSPACE, mode)
        # The reference ranks all five documents. Unrestricted, the dense side is an HNSW scan of
        # the shared index, which late in a run holds thousands of dead entries of earlier tests'
        # rolled-back chunks, many of these same texts: the widest candidate list reaches past them
        # (at the default one, a CI run once found only the salaries).
        everything = documents_found(office, OPERATOR, mode, top_k=4, ef_search=1000)
    assert alice[0] == office.salary.pk and everything[0] == office.salary.pk
    assert office.salary.pk not in bob and office.salary.pk not in workspace_key
    # The others still get a full top k from what they may read, in the same order.
    if mode != "keyword":  # keyword: only the chunks holding a query word rank at all
        assert len(bob) == len(workspace_key) == 3
    assert bob == workspace_key == [pk for pk in everything if pk != office.salary.pk][:3]


def test_a_reader_of_fewer_chunks_than_the_words_match_is_ranked_from_its_readable_rows(office):
    """Bob may read 4 of 8 chunks and the words match 5: keyword ranking starts from what he
    may read. A plain query is held to its ranked terms by the BM25 test alone; a typed phrase
    or exclusion still tests each row's words."""
    tokyo = ingest_texts(
        office.collection,
        {f"tokyo-{n}.md": f"# Tokyo {n}\n\nThe Tokyo office floor {n} plan." for n in range(3)},
    )
    for pk in tokyo:
        document_readers_set(document=Document.objects.get(pk=pk), readers=readers_for(groups=["hr"]))
    desks = Document.objects.get(source_name="desks.md").pk

    def found(query: str) -> list[int]:
        result = chunk_search(
            query=query, workspace=office.workspace, mode="keyword", reader=reader_of_user(office.bob)
        )
        assert result.keyword_path == "exact"
        return [hit.document_id for hit in result.hits]

    assert found("Tokyo office") == [desks]
    assert found('"Tokyo office"') == [desks]
    assert found('"office Tokyo"') == []
    assert found("Tokyo -hot") == []
    assert set(found("Tokyo")) == {desks}  # the salary and the three plans are hr's


def test_a_change_of_readers_holds_on_the_next_search_without_reembedding(office):
    chunks = list(Chunk.objects.filter(document=office.salary).values_list("pk", "embedding"))
    document_readers_set(document=office.salary, readers=readers_for(users=[office.bob.pk]))
    assert documents_found(office, reader_of_user(office.bob), "hybrid")[0] == office.salary.pk
    assert office.salary.pk not in documents_found(office, reader_of_user(office.alice), "hybrid")
    assert list(Chunk.objects.filter(document=office.salary).values_list("pk", "embedding")) == chunks
    assert chunk_readers(office.salary) == {(f"u:{office.bob.pk}",)}
    # Leaving the group takes effect on the next request too.
    document_readers_set(document=office.salary, readers=readers_for(groups=["hr"]))
    office.alice.groups.remove(office.hr)
    assert office.salary.pk not in documents_found(office, reader_of_user(office.alice), "hybrid")


def test_readers_name_users_and_groups_that_exist_and_nothing_else(office):
    with pytest.raises(AccessError, match=r"no such user 999999, group 'finance'"):
        readers_for(users=[999999], groups=["finance"])
    with pytest.raises(AccessError, match="named by its id or its name, not true"):
        readers_for(users=[True])
    assert readers_for() == ["*"]
    assert readers_for(users=["alice", office.alice.pk], groups=[office.hr.pk]) == [
        f"u:{office.alice.pk}",
        f"g:{office.hr.pk}",
    ]
    # A deleted user's principal stays on the document and grants nothing to anyone.
    carol = get_user_model().objects.create_user("carol")
    document_readers_set(document=office.salary, readers=readers_for(users=[carol.pk]))
    carol.delete()
    for user in (office.alice, office.bob):
        assert office.salary.pk not in documents_found(office, reader_of_user(user), "hybrid")


# --------------------------------------------------------------------------- answers


def test_an_answer_quotes_and_cites_only_what_its_asker_may_read(office):
    alice = answer_create(workspace=office.workspace, question=SALARY_QUESTION, reader=reader_of_user(office.alice))
    bob = answer_create(workspace=office.workspace, question=SALARY_QUESTION, reader=reader_of_user(office.bob))
    assert "9 to 14 million yen" in alice.text
    assert {citation["document_id"] for citation in alice.citations} == {office.salary.pk}
    assert "million" not in bob.text and bob.abstained
    assert office.salary.pk not in {source["document_id"] for source in bob.sources}
    assert office.salary.title not in bob.text


def test_a_follow_up_after_losing_access_neither_retrieves_nor_quotes_the_passage(office):
    reader = reader_of_user(office.alice)
    first = answer_create(workspace=office.workspace, question=SALARY_QUESTION, reader=reader, asker=office.alice)
    assert "9 to 14 million yen" in first.text
    assert history_of(first.conversation, reader=reader)[0].answer != ""

    office.alice.groups.remove(office.hr)  # she moves out of HR between the two turns
    reader = reader_of_user(office.alice)
    second = answer_create(
        workspace=office.workspace,
        question="And for senior engineers in Tokyo, is that a year?",
        conversation=first.conversation,
        reader=reader,
        asker=office.alice,
    )
    assert office.salary.pk not in {source["document_id"] for source in second.sources}
    assert "million" not in second.text
    # The earlier answer quoted the passage: the history the second turn was read with leaves
    # it out, keeping the question.
    turn = history_of(first.conversation, reader=reader)[0]
    assert (turn.question, turn.answer) == (SALARY_QUESTION, "")


# --------------------------------------------------------------------------- REST API


def session_client(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def test_the_rest_api_shows_a_restricted_document_to_its_readers_only(office):
    _, token = client_keys.client_key_create(office.workspace, "k", scopes=["admin"])
    key = APIClient()
    key.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    alice, bob = session_client(office.alice), session_client(office.bob)
    pk = office.salary.pk
    for client, reads in ((alice, True), (bob, False), (key, False)):
        listed = client.get("/api/v1/documents").json()
        assert (pk in {item["id"] for item in listed["results"]}) is reads
        assert listed["count"] == len(OPEN) + reads
        (collection,) = client.get("/api/v1/collections").json()["results"]
        assert collection["document_count"] == len(OPEN) + reads
        for path in (f"/api/v1/documents/{pk}", f"/api/v1/documents/{pk}/file"):
            assert client.get(path).status_code == (200 if reads else 404), path
        found = client.post("/api/v1/search", {"query": SALARY_QUESTION, "top_k": 5}, format="json").json()
        assert (pk in {hit["document_id"] for hit in found["results"]}) is reads
        answer = client.post("/api/v1/answers?wait=30", {"question": SALARY_QUESTION}, format="json").json()
        assert ("9 to 14 million yen" in answer["text"]) is reads
        assert (pk in {citation["document_id"] for citation in answer["citations"]}) is reads
    detail = alice.get(f"/api/v1/documents/{pk}").json()
    assert detail["readers"] == {"everyone": False, "users": [], "groups": [office.hr.pk]}
    # Bob may not change who reads a document he cannot see: it is not found, and unchanged.
    refused = bob.post(f"/api/v1/documents/{pk}/readers", {"users": ["bob"]}, format="json")
    assert refused.status_code == 404 and Document.objects.get(pk=pk).readers == [f"g:{office.hr.pk}"]


def test_readers_are_set_through_the_api_and_bad_ones_are_refused_by_name(office):
    alice = session_client(office.alice)
    url = f"/api/v1/documents/{office.salary.pk}/readers"
    refused = alice.post(url, {"users": ["nobody", 999999], "groups": ["hr"]}, format="json")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["field"] == "readers" and error["message"].startswith("no such user 999999, user 'nobody'")
    # Another tenant's user and group are as missing as names nobody took: nothing confirms they exist.
    elsewhere = workspace_create(name="Elsewhere", slug="elsewhere")
    carol = get_user_model().objects.create_user("carol", password="pw-carol")
    Membership.objects.create(workspace=elsewhere, user=carol)
    carol.groups.add(Group.objects.create(name="legal"))
    foreign = alice.post(url, {"users": ["carol"], "groups": ["legal", "no-such-group"]}, format="json")
    assert foreign.json()["error"]["message"] == (
        "no such user 'carol', group 'legal', group 'no-such-group': a document's readers must exist"
    )
    assert Document.objects.get(pk=office.salary.pk).readers == [f"g:{office.hr.pk}"]
    opened = alice.post(url, {"users": [], "groups": []}, format="json")
    assert opened.status_code == 200 and opened.json()["readers"] == {"everyone": True, "users": [], "groups": []}
    assert chunk_readers(office.salary) == {("*",)}
    assert office.salary.pk in documents_found(office, reader_of_user(office.bob), "hybrid")


def test_an_upload_names_its_readers_and_a_duplicate_of_a_restricted_file_names_nothing(office):
    alice, bob = session_client(office.alice), session_client(office.bob)
    upload = alice.post(
        "/api/v1/documents",
        {
            "collection": office.collection.pk,
            "files": [SimpleUploadedFile("bonus.md", b"# Bonus\n\nThe bonus is paid in June and December.")],
            "readers": '{"groups": ["hr"]}',
        },
        format="multipart",
    )
    assert upload.status_code == 201, upload.content
    (created,) = upload.json()["documents"]
    assert created["readers"] == {"everyone": False, "users": [], "groups": [office.hr.pk]}
    assert Document.objects.get(pk=created["id"]).readers == [f"g:{office.hr.pk}"]
    bad = alice.post(
        "/api/v1/documents",
        {"collection": office.collection.pk, "files": [SimpleUploadedFile("x.md", b"x")], "readers": '{"teams": []}'},
        format="multipart",
    )
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "readers"
    # Bob holds the same salary file: the upload is refused without its id, title or readers.
    duplicate = bob.post(
        "/api/v1/documents",
        {"collection": office.collection.pk, "files": [SimpleUploadedFile("mine.md", office.salary.file.read())]},
        format="multipart",
    )
    assert duplicate.status_code == 400
    error = duplicate.json()["error"]
    assert error["message"] == "mine.md: the same file is already in this collection, restricted to others"
    assert str(office.salary.pk) not in duplicate.content.decode() and "Salaries" not in duplicate.content.decode()


# --------------------------------------------------------------------------- browser UI and the OpenAI door


def test_the_ui_shows_a_restricted_document_to_its_readers_only(office):
    chunk = Chunk.objects.filter(document=office.salary).first()
    for user, reads in ((office.alice, True), (office.bob, False)):
        client = Client()
        client.force_login(user)
        page = client.get("/", {"q": SALARY_QUESTION}).content.decode()
        assert (f'href="/passages/{chunk.pk}/"' in page) is reads
        assert (office.salary.title in client.get("/documents/").content.decode()) is reads
        assert client.get(f"/passages/{chunk.pk}/").status_code == (200 if reads else 404)
        assert client.get(f"/documents/{office.salary.pk}/file/").status_code == (200 if reads else 404)


def test_the_openai_door_reads_as_its_keys_workspace(office):
    _, token = client_keys.client_key_create(office.workspace, "k", scopes=["generate"])
    body = {"model": "extractive", "messages": [{"role": "user", "content": SALARY_QUESTION}]}
    response = Client().post(
        "/v1/chat/completions", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}"
    )
    assert response.status_code == 200, response.content
    completion = response.json()
    assert "million" not in completion["choices"][0]["message"]["content"]
    assert office.salary.pk not in {citation["document_id"] for citation in completion.get("citations", [])}


# --------------------------------------------------------------------------- ingest command


def test_ingest_restricts_new_documents_to_the_named_readers(office, tmp_path):
    folder = tmp_path / "hr"
    folder.mkdir()
    (folder / "reviews.md").write_text("# Reviews\n\nPerformance reviews happen every October.")
    call_command(
        "ingest", str(folder), workspace="acme", collection="Handbook", reader_group=["hr"], stdout=io.StringIO()
    )
    document = Document.objects.get(source_name="reviews.md")
    assert document.readers == [f"g:{office.hr.pk}"]
    assert chunk_readers(document) == {(f"g:{office.hr.pk}",)}
    with pytest.raises(CommandError, match="no such group 'finance'"):
        call_command("ingest", str(folder), workspace="acme", reader_group=["finance"], stdout=io.StringIO())


def test_a_document_uploaded_for_its_readers_is_indexed_with_them(office):
    document, created = document_create(
        collection=office.collection,
        source_name="pay.md",
        content=b"# Pay\n\nPay day is the 25th.",
        readers=readers_for(users=["bob"]),
        enqueue=False,
    )
    pipeline.documents_ingest(document_ids=[document.pk])
    assert created and chunk_readers(document) == {(f"u:{office.bob.pk}",)}


def test_a_key_reads_what_the_user_or_group_it_acts_for_may_read(office):
    def reads_salary(**acts_for) -> tuple[bool, bool]:
        _, token = client_keys.client_key_create(office.workspace, "k", scopes=["admin"], **acts_for)
        key = APIClient()
        key.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        found = key.post("/api/v1/search", {"query": SALARY_QUESTION, "top_k": 5}, format="json").json()
        body = {"model": "extractive", "messages": [{"role": "user", "content": SALARY_QUESTION}]}
        completion = key.post("/v1/chat/completions", body, format="json").json()
        return (
            office.salary.pk in {hit["document_id"] for hit in found["results"]},
            "9 to 14 million yen" in completion["choices"][0]["message"]["content"],
        )

    assert reads_salary(acts_for_group=office.hr) == (True, True)
    assert reads_salary(acts_for_user=office.alice) == (True, True)
    assert reads_salary(acts_for_user=office.bob) == (False, False)
    assert reads_salary() == (False, False)
    # Alice leaves the workspace: a key acting for her reads what the workspace may read.
    Membership.objects.filter(user=office.alice).delete()
    assert reads_salary(acts_for_user=office.alice) == (False, False)
    with pytest.raises(ValueError, match="a user or for a group, not both"):
        client_keys.client_key_create(office.workspace, "k", acts_for_user=office.bob, acts_for_group=office.hr)


def test_the_upload_form_restricts_to_the_chosen_groups_and_the_uploader(office):
    other = workspace_create(name="Other", slug="other")
    outsider = get_user_model().objects.create_user("olga")
    outsider.groups.add(Group.objects.create(name="other-finance"))
    Membership.objects.create(workspace=other, user=outsider)
    client = Client()
    client.force_login(office.alice)
    page = client.get("/documents/").content.decode()
    assert f'<option value="{office.hr.pk}">hr</option>' in page and "other-finance" not in page
    response = client.post(
        "/documents/upload/",
        {
            "collection": office.collection.pk,
            "files": [SimpleUploadedFile("review.md", b"# Review\n\nReviews are in October.")],
            "readers": [office.hr.pk],
        },
    )
    assert response.status_code == 302
    document = Document.objects.get(source_name="review.md")
    assert document.readers == [f"u:{office.alice.pk}", f"g:{office.hr.pk}"]
    listed = client.get("/documents/").content.decode()
    assert listed.count(">Restricted</span>") == 2  # the salaries and the review


def test_an_answer_citing_a_document_is_withheld_from_whoever_may_not_read_it(office):
    """Alice's answer quotes the salaries; Bob opens it by its id (the UI, the REST API, its
    streams), and Alice herself once she has left HR: the question only, never the passage."""
    answer = answer_create(
        workspace=office.workspace, question=SALARY_QUESTION, reader=reader_of_user(office.alice), asker=office.alice
    )
    assert "9 to 14 million yen" in answer.text

    def shown_to(user) -> tuple[str, str, int, int, str]:
        browser = Client()
        browser.force_login(user)
        page = browser.get(f"/answers/{answer.pk}/").content.decode()
        api = session_client(user)
        detail = api.get(f"/api/v1/answers/{answer.pk}").json()
        conversation = api.get(f"/api/v1/conversations/{answer.conversation_id}")
        return (
            page,
            str(detail),
            browser.get(f"/answers/{answer.pk}/events/").status_code,
            api.get(f"/api/v1/answers/{answer.pk}/stream").status_code,
            f"{conversation.status_code} {conversation.content.decode()}",
        )

    page, detail, ui_stream, api_stream, conversation = shown_to(office.alice)
    assert "9 to 14 million yen" in page and "9 to 14 million yen" in detail and "million" in conversation
    assert (ui_stream, api_stream) == (200, 200)
    office.alice.groups.remove(office.hr)  # she leaves HR
    for user in (office.bob, office.alice):
        page, detail, ui_stream, api_stream, conversation = shown_to(user)
        assert SALARY_QUESTION in page and "million" not in page and "Salaries" not in page
        assert "million" not in detail and "'withheld': True" in detail and "'sources': []" in detail
        assert (ui_stream, api_stream) == (404, 404)
        # Bob's is not his conversation at all; Alice's own shows the question, withheld.
        assert conversation.startswith("404" if user == office.bob else "200") and "million" not in conversation
