"""The browser UI end to end: headless Chromium (Selenium, through the system's chromedriver)
against the site under uvicorn, with an ``ingest``+``default`` Celery worker, on the test
database. A user logs in, uploads a file and watches it reach "Indexed", searches, asks (no
route is configured, so the answer is extractive, streamed through the same SSE view), opens
a citation, and stops an answer that is still being written.

Screenshots (the search page at desktop and phone widths, the cited passage, the documents)
are kept as test artifacts in ``test-artifacts/`` at the repository's root (git-ignored;
``TEST_ARTIFACTS_DIR`` to put them elsewhere), replaced by each run; their paths are printed
(``pytest -s`` shows them). Without Chromium, chromedriver or
selenium the test is skipped, saying what to install (tests/browser.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from inference.streams import StreamWriter
from search.models import Answer, Chunk
from search.services import collection_create, workspace_create
from tests.browser import console_errors, wait_until
from tests.frontdoors.ui.conftest import PASSWORD, member
from tests.search.answering.test_conversations import FIRST, FOLLOW_UP, FOLLOW_UP_QUERY, TRAVEL
from tests.search.files import ingest_texts as ingest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]  # the server sees committed rows

ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR") or Path(__file__).resolve().parents[3] / "test-artifacts")
ROBOT = (
    "# Atlas-7 robot\n\nThe Atlas-7 warehouse robot runs for 10 hours on one battery charge. "
    "Charging the battery takes 90 minutes at the dock.\n\n## Maintenance\n\n"
    "The wheels are replaced every 2,000 hours of operation."
)


def test_log_in_upload_search_ask_and_open_a_citation(browser, start_web, start_worker, settings, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as shown

    workspace = workspace_create(name="Acme", slug="acme")
    collection_create(workspace=workspace, name="Handbook")
    ann = member("ann", workspace)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    upload = tmp_path / "atlas-robot.md"
    upload.write_text(ROBOT)
    shared_media = {"MEDIA_ROOT": str(settings.MEDIA_ROOT)}  # the server stores what the worker reads

    with start_worker(["ingest", "default"], env=shared_media), start_web(env=shared_media) as base_url:
        # Log in: the documents page asks for it first, then comes back.
        browser.get(f"{base_url}/documents/")
        assert "/accounts/login/" in browser.current_url
        browser.find_element(By.ID, "id_username").send_keys("ann")
        browser.find_element(By.ID, "id_password").send_keys(PASSWORD, Keys.ENTER)
        wait_until(browser, shown.text_to_be_present_in_element((By.TAG_NAME, "h1"), "Documents in Acme"))
        ActionChains(browser).send_keys(Keys.TAB).perform()
        assert browser.switch_to.active_element.text == "Skip to main content"  # the first stop for keyboards

        # Upload (the file input; dropping files fills the same input) and watch it get indexed.
        browser.find_element(By.ID, "id_files").send_keys(str(upload))
        browser.find_element(By.CSS_SELECTOR, ".upload-form button[type='submit']").click()
        wait_until(browser, shown.text_to_be_present_in_element((By.ID, "upload-report"), "queued for indexing"))
        wait_until(
            browser,
            shown.presence_of_element_located((By.CSS_SELECTOR, "#document-list tr[data-status='indexed']")),
            timeout=45,
            message="the uploaded document was not indexed",
        )
        wait_until(browser, shown.text_to_be_present_in_element((By.ID, "document-summary"), "1 indexed"))
        browser.save_screenshot(str(ARTIFACTS / "documents.png"))

        # Search: highlighted snippets, linked to their passages.
        browser.find_element(By.LINK_TEXT, "Search").click()
        browser.find_element(By.ID, "id_q").send_keys("How long does the robot battery last?", Keys.ENTER)
        hit = wait_until(browser, shown.presence_of_element_located((By.CSS_SELECTOR, ".hit")))
        assert hit.find_elements(By.TAG_NAME, "mark") and "Atlas-7 robot" in hit.text

        # Ask: the extractive answer streams in, labelled, with numbered citations.
        browser.find_element(By.XPATH, "//button[normalize-space()='Ask']").click()
        answer = wait_until(browser, shown.presence_of_element_located((By.CSS_SELECTOR, ".answer[data-state='done']")))
        assert "Extractive answer" in answer.text
        assert answer.find_element(By.CSS_SELECTOR, "[data-answer-text]").text.startswith("Extracted from the sources")
        assert answer.find_element(By.CSS_SELECTOR, "[data-answer-status]").text == "Done."
        screenshot = ARTIFACTS / "search.png"
        browser.save_screenshot(str(screenshot))
        print(f"search page screenshot: {screenshot}")

        # A citation opens its passage, highlighted, in a dialog; Escape closes it.
        citation = answer.find_element(By.CSS_SELECTOR, "a.cite")
        assert citation.get_attribute("aria-label").startswith("Source 1: ")
        citation.click()
        dialog = wait_until(browser, shown.visibility_of_element_located((By.ID, "passage-dialog")))
        highlighted = wait_until(browser, lambda _: dialog.find_element(By.CSS_SELECTOR, ".passage-hit"))
        assert "battery" in highlighted.text
        browser.save_screenshot(str(ARTIFACTS / "citation.png"))
        browser.switch_to.active_element.send_keys(Keys.ESCAPE)
        wait_until(browser, shown.invisibility_of_element_located((By.ID, "passage-dialog")))

        # A conversation: a question, then a follow-up that only makes sense with it, asked
        # under the answer on its page; the follow-up's answer cites the passage it needs,
        # and the thread is the same after a reload, and listed.
        travel = collection_create(workspace=workspace, name="Travel")
        ingest(travel, TRAVEL)
        browser.get(f"{base_url}/?collection={travel.pk}")
        browser.find_element(By.ID, "id_q").send_keys(FIRST)
        browser.find_element(By.XPATH, "//button[normalize-space()='Ask']").click()
        wait_until(
            browser, shown.presence_of_element_located((By.CSS_SELECTOR, "#answer-panel .answer[data-state='done']"))
        )
        browser.find_element(By.LINK_TEXT, "Link to this answer").click()
        browser.find_element(By.ID, "follow-up-q").send_keys(FOLLOW_UP, Keys.ENTER)
        wait_until(
            browser,
            shown.text_to_be_present_in_element((By.CSS_SELECTOR, ".turn-current [data-answer-status]"), "Done."),
        )
        follow = browser.find_element(By.CSS_SELECTOR, ".turn-current .answer")
        assert "EUR 90 a day in Berlin" in follow.find_element(By.CSS_SELECTOR, "[data-answer-text]").text
        assert f"Searched for: {FOLLOW_UP_QUERY}" in follow.text
        cited = follow.find_element(By.CSS_SELECTOR, "a.cite").get_attribute("href")
        per_diem = Chunk.objects.get(document__collection=travel, document__source_name="per_diem.md")
        assert cited.endswith(f"/passages/{per_diem.pk}/")
        assert follow.find_element(By.CSS_SELECTOR, ".sources summary").text == "Sources (3)"  # the same collection
        questions = [q.text for q in browser.find_elements(By.CSS_SELECTOR, ".thread .question")]
        assert questions == [f"Question: {FIRST}", f"Question: {FOLLOW_UP}"]
        browser.save_screenshot(str(ARTIFACTS / "conversation.png"))
        browser.refresh()
        assert [q.text for q in browser.find_elements(By.CSS_SELECTOR, ".thread .question")] == questions
        browser.find_element(By.LINK_TEXT, "Conversations").click()
        listed = browser.find_element(By.CSS_SELECTOR, ".answer-list li")
        assert FIRST in listed.text and "2 questions" in listed.text

        browser.set_window_size(390, 844)  # a phone
        browser.save_screenshot(str(ARTIFACTS / "search-phone.png"))
        print(f"phone-width screenshot: {ARTIFACTS / 'search-phone.png'}")

        # An answer still being written streams on its own page, and can be stopped.
        chunk = Chunk.objects.get(document__collection__name="Handbook")
        pending = Answer.objects.create(
            workspace=workspace,
            asker=ann,
            question="Still thinking?",
            status=Answer.Status.GENERATING,
            sources=[{"number": 1, "chunk_id": chunk.pk, "document_id": chunk.document_id, "title": "Atlas-7 robot"}],
        )
        writer = StreamWriter(str(pending.id))
        writer.write("sentence", text="Ten hours [")  # a citation split across two deltas
        browser.get(f"{base_url}/answers/{pending.pk}/")
        text = browser.find_element(By.CSS_SELECTOR, "[data-answer-text]")

        def shown_text() -> str:  # exactly, spaces included (WebDriver's .text trims)
            return text.get_attribute("textContent")

        wait_until(browser, lambda _: shown_text() == "Ten hours ")  # the open bracket waits for the rest
        writer.write("sentence", text="1], then more")
        wait_until(browser, lambda _: shown_text() == "Ten hours [1], then more")
        assert text.find_element(By.CSS_SELECTOR, "a.cite").get_attribute("href").endswith(f"/passages/{chunk.pk}/")
        browser.find_element(By.CSS_SELECTOR, "[data-answer-stop]").click()
        assert browser.find_element(By.CSS_SELECTOR, "[data-answer-status]").text == "Stopped."
        writer.write("sentence", text=" that nobody reads.")
        time.sleep(0.5)
        assert shown_text() == "Ten hours [1], then more"
        # The whole walk ran under the content security policy (ragsite/settings.py) with no
        # violation and no script error.
        assert console_errors(browser) == []


REPORTS = {
    f"売上報告_{quarter}.md": (
        f"---\ndate: {date}\n---\n# 売上報告（{quarter}）\n\n## 概要\n\n{quarter}の売上高は{amount}となりました。\n"
    )
    for quarter, date, amount in [
        ("2025年度第4四半期", "2026-04-16", "11億3,600万円"),
        ("2026年度第1四半期", "2026-07-15", "7億9,800万円"),
        ("2026年度第2四半期", "2026-10-15", "12億7,500万円"),
    ]
}


def test_in_japanese_upload_shift_jis_search_and_ask_for_the_latest_report(
    japanese_browser, start_web, start_worker, settings, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as shown
    from selenium.webdriver.support.ui import Select

    browser = japanese_browser
    workspace = workspace_create(name="東京本社", slug="tokyo")
    ingest(collection_create(workspace=workspace, name="売上報告"), REPORTS)
    collection_create(workspace=workspace, name="社内規程")
    member("hanako", workspace)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    upload = tmp_path / "経費精算規程.txt"
    upload.write_bytes(
        "経費精算規程\n\n国内出張の日当は1日あたり3,000円です。領収書の原本を添付してください。\n".encode("cp932")
    )
    shared_media = {"MEDIA_ROOT": str(settings.MEDIA_ROOT)}

    def language() -> str:
        return browser.find_element(By.TAG_NAME, "html").get_attribute("lang")

    with start_worker(["ingest", "default"], env=shared_media), start_web(env=shared_media) as base_url:
        browser.get(f"{base_url}/documents/")
        assert language() == "ja"
        assert browser.find_element(By.CSS_SELECTOR, "h1").text == "ログイン"
        browser.find_element(By.ID, "id_username").send_keys("hanako")
        browser.find_element(By.ID, "id_password").send_keys(PASSWORD, Keys.ENTER)
        wait_until(browser, shown.text_to_be_present_in_element((By.TAG_NAME, "h1"), "東京本社 の文書"))

        # A Shift_JIS file with a Japanese name: decoded, indexed, listed under its own name.
        Select(browser.find_element(By.ID, "id_collection")).select_by_visible_text("社内規程")
        browser.find_element(By.ID, "id_files").send_keys(str(upload))
        browser.find_element(By.CSS_SELECTOR, ".upload-form button[type='submit']").click()
        wait_until(browser, shown.text_to_be_present_in_element((By.ID, "upload-report"), "経費精算規程.txt"))
        wait_until(
            browser,
            lambda _: len(browser.find_elements(By.CSS_SELECTOR, "#document-list tr[data-status='indexed']")) == 4,
            timeout=60,
            message="the Shift_JIS upload was not indexed",
        )
        assert "経費精算規程.txt" in browser.find_element(By.ID, "document-list").text

        # Search: the uploaded file found by a Japanese word, the word marked.
        browser.find_element(By.LINK_TEXT, "検索").click()
        browser.find_element(By.ID, "id_q").send_keys("日当", Keys.ENTER)
        hit = wait_until(browser, shown.presence_of_element_located((By.CSS_SELECTOR, ".hit")))
        assert [mark.text for mark in hit.find_elements(By.TAG_NAME, "mark")] == ["日当"]

        # Ask for the latest report: answered from it (no model: quoted, saying so in Japanese).
        query = browser.find_element(By.ID, "id_q")
        query.clear()
        query.send_keys("最新の売上報告を教えてください")
        browser.find_element(By.XPATH, "//button[normalize-space()='質問する']").click()
        answer = wait_until(browser, shown.presence_of_element_located((By.CSS_SELECTOR, ".answer[data-state='done']")))
        text = answer.find_element(By.CSS_SELECTOR, "[data-answer-text]").text
        assert text.startswith("資料から抜粋しました（生成モデルが設定されていません）：")
        assert "12億7,500万円" in text and "7億9,800万円" not in text
        latest = Chunk.objects.get(document__source_name="売上報告_2026年度第2四半期.md")
        cited = answer.find_element(By.CSS_SELECTOR, "a.cite").get_attribute("href")
        assert cited.endswith(f"/passages/{latest.pk}/")
        browser.save_screenshot(str(ARTIFACTS / "search-japanese.png"))

        # The switch to English is kept after a reload (and for the account).
        Select(browser.find_element(By.ID, "language-select")).select_by_value("en")
        browser.find_element(By.CSS_SELECTOR, ".language-switcher button").click()
        wait_until(browser, lambda _: language() == "en")
        browser.refresh()
        assert language() == "en"
        assert browser.find_element(By.XPATH, "//nav/a[1]").text == "Search"
        assert console_errors(browser) == []
