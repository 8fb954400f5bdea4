"""Headless Chromium for the end-to-end tests (Selenium, through the system's chromedriver).

Chromium starts with the flags these machines need, and keeps the browser console so that a
test can read what the page logged (``console_errors``): a content-security-policy
violation or an uncaught script error shows there. Without Chromium, chromedriver or
selenium the tests that use the ``browser`` fixture (tests/conftest.py) are skipped, saying
what to install; where ``CI`` is set (``.ci/run`` sets it, and installs Chromium) they fail
instead, so that the real-browser check cannot silently stop running.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1000",
)


def unavailable(reason: str) -> None:
    """Skip the test, saying why; fail it under CI, which must run it."""
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the browser tests, but {reason}", pytrace=False)
    pytest.skip(reason)


@contextmanager
def chromium(accept_language: str = "") -> Iterator:
    """``accept_language``: what the browser asks for ("ja,en"), as a Japanese user's does."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium is not installed: .venv/bin/pip install -r requirements-dev.txt")
    binary = next(filter(None, map(shutil.which, BROWSERS)), None)
    chromedriver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", binary), ("chromedriver", chromedriver)) if path is None]
    if missing:
        unavailable(
            f"headless browser tests need {' and '.join(missing)} on PATH "
            "(Debian/Ubuntu: apt install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    if accept_language:
        options.add_argument(f"--lang={accept_language.split(',')[0]}")
        options.add_experimental_option("prefs", {"intl.accept_languages": accept_language})
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(driver, condition, timeout: float = 15, message: str = ""):
    """``condition`` polled until it holds. One that reads an element the page is replacing
    (a reload, a navigation under way) is asked again rather than failing: that element was
    stale, not the condition false."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException])
    return wait.until(condition, message)


def console_errors(driver) -> list[str]:
    """The browser console's errors since the last call (reading the log empties it)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
