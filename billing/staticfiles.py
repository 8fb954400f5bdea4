"""Serves plotly.js from the ``plotly`` wheel as the static file ``billing/vendor/plotly.min.js``.

The dashboards draw their charts with plotly.js. The browser gets it from our own static
files, never from a CDN (the admin works offline and leaks nothing to a third party), and
the file comes from the pinned ``plotly`` package (requirements.txt), so upgrading is a
pin change, with no copy of a 4.8 MB bundle in the repository.

This finder exposes that one file of the wheel (not its data sets and widget bundle), so
it works everywhere Django's finders do: ``collectstatic`` (copied under STATIC_ROOT with
the other files) and ServeStatic's ``SERVESTATIC_USE_FINDERS`` (served straight from the
wheel). Listed in ``STATICFILES_FINDERS`` (ragsite/settings.py).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from django.contrib.staticfiles import utils
from django.contrib.staticfiles.finders import BaseFinder, searched_locations
from django.core.checks import Error
from django.core.files.storage import FileSystemStorage

PREFIX = "billing/vendor"
NAME = "plotly.min.js"
PATH = f"{PREFIX}/{NAME}"


def bundle_directory() -> Path:
    return Path(str(files("plotly") / "package_data"))


class PlotlyFinder(BaseFinder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.location = bundle_directory()
        storage = FileSystemStorage(location=self.location)
        # collectstatic and ServeStatic put a storage's files under its ``prefix``.
        storage.prefix = PREFIX
        self.storage = storage
        # Read by ServeStatic's error page (DEBUG) and Django's own finder helpers.
        self.storages = {str(self.location): storage}

    def check(self, **kwargs):
        if not (self.location / NAME).is_file():
            return [Error(f"{NAME} is missing from the plotly package at {self.location}", id="billing.E001")]
        return []

    def find(self, path, find_all=False, **kwargs):
        if kwargs:  # Django < 6.1 still passes the deprecated ``all``
            find_all = self._check_deprecated_find_param(find_all=find_all, **kwargs)
        if str(self.location) not in searched_locations:
            searched_locations.append(str(self.location))
        if path != PATH or not (self.location / NAME).is_file():
            return [] if find_all else None
        found = str(self.location / NAME)
        return [found] if find_all else found

    def list(self, ignore_patterns):
        patterns = ignore_patterns or []
        if utils.matches_patterns(NAME, patterns) or utils.matches_patterns(PATH, patterns):
            return
        if (self.location / NAME).is_file():
            yield NAME, self.storage
