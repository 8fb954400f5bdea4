"""The UI in Japanese and English (docs/ui.md "Languages"): the browser's Accept-Language
chooses, the header's switcher changes it and a signed-in user's choice is kept on the
account; messages, form errors, dates and the script's words follow; the APIs do not.
The catalogue itself is checked in test_translations.py."""

from __future__ import annotations

import json
import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse
from django.utils import timezone, translation

from frontdoors.ui.languages import domain_text, script_strings
from ragsite.models import UserPreference
from search.models import Answer, Document
from tests.conftest import PROJECT_ROOT
from tests.frontdoors.ui.conftest import PASSWORD
from tests.frontdoors.ui.test_views import HTMX, answer_in

# What browsers send: a Japanese one, an English one, and one asking for neither language.
JA = {"HTTP_ACCEPT_LANGUAGE": "ja-JP,ja;q=0.9,en-US;q=0.8,en;q=0.7"}
EN = {"HTTP_ACCEPT_LANGUAGE": "en-US,en;q=0.9"}
FR = {"HTTP_ACCEPT_LANGUAGE": "fr-FR,fr;q=0.9"}
COOKIE = "django_language"


@pytest.fixture(autouse=True)
def _default_language_after():
    """A view activates a language in the test's own thread: leave the default behind."""
    yield
    translation.deactivate()


def html(response) -> str:
    return response.content.decode()


def ui_strings(page: str) -> dict:
    return json.loads(re.search(r'<script id="ui-strings" type="application/json">(.*?)</script>', page, re.S)[1])


def log_in(client, **headers):
    response = client.post("/accounts/login/", {"username": "ann", "password": PASSWORD}, **headers)
    assert response.status_code == 302, html(response)


def test_a_japanese_browser_gets_every_page_in_japanese(client, tenants):
    login = client.get("/accounts/login/", **JA)
    page = html(login)
    assert '<html lang="ja">' in page and login["Content-Language"] == "ja"
    assert "<title>ログイン – RAG 検索</title>" in page
    assert '<label for="id_username">ユーザー名</label>' in page
    assert '<button type="submit" class="primary">ログイン</button>' in page

    log_in(client, **JA)
    search = html(client.get("/", {"q": "robot battery charge", "mode": "keyword"}, **JA))
    assert '<html lang="ja">' in search
    assert "<h1>Acme を検索</h1>" in search and '<a class="skip-link" href="#main">本文へ移動</a>' in search
    assert (
        ">検索語または質問</label>" in search
        and '<option value="keyword" selected>キーワード（BM25）</option>' in search
    )
    assert re.search(r"「robot battery charge」の検索結果 \d+ 件", search) and "キーワード検索 1 位" in search
    assert ">質問する</button>" in search
    # ui.js's words come with the page, in its language.
    assert ui_strings(search)["writing"] == "回答を作成しています…"
    assert ui_strings(search)["unsupported_other"] == ui_strings(search)["unsupported_one"]

    documents = html(client.get("/documents/", **JA))
    assert '<html lang="ja">' in documents and "<h1>Acme の文書</h1>" in documents
    assert "文書 2 件：インデックス済み 2 件、処理中 0 件、失敗 0 件。" in documents
    assert '<span class="status status-indexed">インデックス済み</span>' in documents
    assert '<button type="submit" class="primary">アップロード</button>' in documents
    assert "テキスト、Markdown、HTML、PDF、Word（.docx）に対応しています。1 ファイル 50 MB までです。" in documents

    answer = answer_in(tenants.acme, tenants.ann, question="電池はどのくらい持ちますか？", status=Answer.Status.DONE)
    answers = html(client.get("/answers/", **JA))
    assert '<html lang="ja">' in answers and "<h1>Acme でのあなたの会話</h1>" in answers
    assert "質問 1 件" in answers and "前</time>" in answers
    detail = html(client.get(reverse("ui:answer", args=[answer.pk]), **JA))
    assert '<h2 id="answer-' in detail and ">回答</h2>" in detail and "完了しました。" in detail
    # The date in Japanese form (2026年12月5日…), not "Dec. 5, 2026".
    asked = timezone.localtime(answer.created_at)
    assert f">{asked.year}年{asked.month}月{asked.day}日{asked.hour}:{asked.minute:02}</time>" in detail
    assert "に質問しました。" in detail


def test_an_english_browser_and_one_asking_for_neither_get_english(client, tenants):
    for headers in (EN, FR, {}):
        page = html(client.get("/accounts/login/", **headers))
        assert '<html lang="en">' in page and '<label for="id_username">Username</label>' in page
    client.force_login(tenants.ann)
    for headers in (EN, FR):
        search = html(client.get("/", **headers))
        assert '<html lang="en">' in search and "<h1>Search Acme</h1>" in search
        assert ui_strings(search)["writing"] == "Writing the answer…"
        documents = html(client.get("/documents/", **headers))
        assert "2 documents: 2 indexed, 0 in progress, 0 failed." in documents


def test_the_switcher_sets_the_language_and_a_signed_in_users_choice_follows_them(client, tenants):
    log_in(client, **JA)
    page = html(client.get("/", **JA))
    assert 'action="/language/"' in page and '<option value="en" lang="en">English</option>' in page
    assert '<option value="ja" lang="ja" selected>日本語</option>' in page

    switched = client.post(reverse("ui:language"), {"language": "en", "next": "/documents/"}, **JA)
    assert switched.status_code == 302 and switched["Location"] == "/documents/"
    assert switched.cookies[COOKIE].value == "en"
    assert UserPreference.objects.get(user=tenants.ann).language == "en"
    assert "<h1>Documents in Acme</h1>" in html(client.get("/documents/", **JA))

    # A new session in another browser, Japanese and without the cookie: English after the
    # login, and the cookie set for the pages that do not look at the account.
    other = Client()
    assert '<html lang="ja">' in html(other.get("/accounts/login/", **JA))
    log_in(other, **JA)
    first = other.get("/", **JA)
    assert '<html lang="en">' in html(first) and "<h1>Search Acme</h1>" in html(first)
    assert first.cookies[COOKIE].value == "en"
    other.post("/accounts/logout/", **JA)
    assert '<html lang="en">' in html(other.get("/accounts/login/", **JA))

    # Back to Japanese, saved too; the cookie is not set again while the browser sends it.
    client.post(reverse("ui:language"), {"language": "ja", "next": "/"}, **EN)
    assert UserPreference.objects.get(user=tenants.ann).language == "ja"
    again = client.get("/", **EN)
    assert '<html lang="ja">' in html(again) and COOKIE not in again.cookies


def test_the_switcher_on_the_login_page_sets_the_cookie_only(client, tenants):
    response = client.post(reverse("ui:language"), {"language": "ja", "next": "/accounts/login/?next=/documents/"})
    assert response["Location"] == "/accounts/login/?next=/documents/" and response.cookies[COOKIE].value == "ja"
    assert '<html lang="ja">' in html(client.get("/accounts/login/", **EN))
    assert not UserPreference.objects.exists()
    # A language the site does not speak changes nothing; the switcher is a POST with its token.
    refused = client.post(reverse("ui:language"), {"language": "fr", "next": "/accounts/login/"})
    assert refused.status_code == 302 and COOKIE not in refused.cookies
    assert client.get(reverse("ui:language")).status_code == 405
    guarded = Client(enforce_csrf_checks=True)
    assert guarded.post(reverse("ui:language"), {"language": "en", "next": "/"}).status_code == 403


def test_messages_and_form_errors_are_in_japanese(client, tenants):
    wrong = html(client.post("/accounts/login/", {"username": "ann", "password": "nope"}, **JA))
    assert "正しいユーザー名とパスワードを入力してください。" in wrong

    client.force_login(tenants.ann)
    empty = client.post(reverse("ui:ask"), {"q": "  "}, **HTMX, **JA)
    assert empty.status_code == 422 and "質問が入力されていません。" in html(empty)
    theirs = client.post(reverse("ui:ask"), {"q": "電池？", "collection": tenants.plans.pk}, **HTMX, **JA)
    assert theirs.status_code == 422 and "正しく選択してください。" in html(theirs)

    no_files = client.post(reverse("ui:upload"), {"collection": tenants.handbook.pk}, **HTMX, **JA)
    assert no_files.status_code == 422 and "この項目は必須です。" in html(no_files)
    refused = client.post(
        reverse("ui:upload"),
        {"collection": tenants.handbook.pk, "files": [SimpleUploadedFile("empty.txt", b"")]},
        **HTMX,
        **JA,
    )
    assert refused.status_code == 422
    assert "empty.txt: ファイルが空です。" in html(refused)
    assert "何も保存されていません。該当するファイルを外すか修正してから、もう一度アップロードしてください。" in html(
        refused
    )
    added = client.post(
        reverse("ui:upload"),
        {"collection": tenants.handbook.pk, "files": [SimpleUploadedFile("notes.md", b"# Notes\n\nDue in 30 days.")]},
        **HTMX,
        **JA,
    )
    assert "notes.md：Handbook でのインデックス作成を待っています。" in html(added)
    assert "1 件中 1 件のファイルを追加しました。" in html(added)

    robot = Document.objects.get(source_name="robot.md")
    deleted = html(client.post(reverse("ui:document_delete", args=[robot.pk]), follow=True, **JA))
    assert "「Atlas-7 robot」を削除しました。" in deleted

    extractive = answer_in(tenants.acme, tenants.ann, status=Answer.Status.DONE, mode=Answer.Mode.EXTRACTIVE)
    page = html(client.get(reverse("ui:answer", args=[extractive.pk]), **JA))
    assert "抜粋による回答です。資料の文をそのまま引用しています（理由：生成モデルが設定されていません）。" in page

    answer = answer_in(tenants.acme, tenants.ann)
    renamed = client.post(
        reverse("ui:conversation_rename", args=[answer.conversation_id]), {"title": "電池"}, follow=True, **JA
    )
    assert "会話の名前を変更しました。" in html(renamed)


def test_the_domains_words_are_translated_where_the_catalogue_has_them():
    with translation.override("ja"):
        assert domain_text("the question is empty") == "質問が入力されていません。"
        assert domain_text("a.pdf: the PDF is encrypted with a password", ["a.pdf"]) == (
            "a.pdf: PDF がパスワードで暗号化されています。"
        )
        assert domain_text("a refusal the catalogue does not know") == "a refusal the catalogue does not know"
        assert domain_text("") == ""  # not the catalogue's header
    with translation.override("en"):
        assert domain_text("the question is empty") == "the question is empty"


def test_the_apis_answer_the_same_whatever_the_language(client, tenants):
    """Their messages stay English: DRF's own among them, which Django has in Japanese."""
    anonymous = client.get("/api/v1/collections")
    assert anonymous.status_code == 401
    assert client.get("/api/v1/collections", **JA).json() == anonymous.json()
    client.force_login(tenants.ann)
    english = client.post("/api/v1/search", {}, content_type="application/json")
    assert english.json() == {
        "error": {"code": "invalid_request", "message": "This field is required.", "field": "query"}
    }
    assert client.post("/api/v1/search", {}, content_type="application/json", **JA).json() == english.json()
    client.cookies[COOKIE] = "ja"  # as the switcher leaves it
    assert client.post("/api/v1/search", {}, content_type="application/json").json() == english.json()
    assert client.put("/api/v1/search", {}, content_type="application/json", **JA).json() == {
        "error": {"code": "method_not_allowed", "message": 'Method "PUT" not allowed.'}
    }
    assert client.post("/v1/chat/completions", {}, content_type="application/json", **JA).json() == (
        Client().post("/v1/chat/completions", {}, content_type="application/json").json()
    )
    # The UI in the same browser does speak Japanese.
    assert '<html lang="ja">' in html(client.get("/"))


def test_the_script_finds_every_word_it_uses_in_the_page():
    """Each ``phrase("key")`` of ui.js is a key of ``script_strings``, and each key is used."""
    script = (PROJECT_ROOT / "static" / "search" / "ui.js").read_text()
    keys = set(script_strings())
    assert set(re.findall(r'phrase\("(\w+)"', script)) <= keys
    assert [key for key in sorted(keys) if f'"{key}"' not in script] == []
    # No sentence of its own left in the script: its user-facing text all comes from the page.
    assert not re.search(r'textContent = [`"][A-Z]', script)
