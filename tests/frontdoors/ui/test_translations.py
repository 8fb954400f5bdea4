"""The Japanese catalogue is complete and compiled (docs/ui.md "Languages").

Every string the UI marks for translation, in the templates (``{% translate %}``,
``{% blocktranslate %}``: read with Django's own ``templatize``, as makemessages reads them) and
in ``frontdoors/ui/`` (``gettext`` and friends), has a Japanese translation in
``locale/ja/LC_MESSAGES/django.po`` that is neither empty nor fuzzy; and the committed
``django.mo``, which is what Django reads, holds every translation of the ``.po`` as it is
there: a ``.po`` edited without ``pybabel compile`` fails here. No GNU gettext is needed.
"""

from __future__ import annotations

import gettext
import io

import pytest
from babel.messages.extract import extract
from babel.messages.pofile import read_po
from django.utils.translation.template import templatize

from tests.conftest import PROJECT_ROOT

CATALOGUE = PROJECT_ROOT / "locale" / "ja" / "LC_MESSAGES"
TEMPLATES = PROJECT_ROOT / "templates"
UI_CODE = PROJECT_ROOT / "frontdoors" / "ui"
# Django's translation functions, as Babel's keyword specifications: the message, or its
# singular and plural, with the context first where there is one.
PYTHON_KEYWORDS = {
    "_": None,
    "gettext": None,
    "gettext_lazy": None,
    "gettext_noop": None,
    "ngettext": (1, 2),
    "ngettext_lazy": (1, 2),
    "pgettext": ((1, "c"), 2),
    "pgettext_lazy": ((1, "c"), 2),
    "npgettext": ((1, "c"), 2, 3),
    "npgettext_lazy": ((1, "c"), 2, 3),
}


def ja_catalogue():
    with (CATALOGUE / "django.po").open("rb") as po:
        return read_po(po, locale="ja")


def template_messages() -> dict[tuple[str | None, str | tuple], str]:
    """(context, msgid) of every translatable string of the templates -> where it is."""
    found = {}
    for path in sorted(TEMPLATES.rglob("*.html")):
        # Python's tokenizer (unlike xgettext) refuses the indentation the template leaves:
        # each line without it, so that the line numbers stay the template's.
        as_python = "\n".join(line.lstrip() for line in templatize(path.read_text(), origin=str(path)).splitlines())
        for line, message, _comments, context in extract("python", io.BytesIO(as_python.encode())):
            found[(context, message)] = f"{path.relative_to(PROJECT_ROOT)}:{line}"
    return found


def ui_code_messages() -> dict[tuple[str | None, str | tuple], str]:
    found = {}
    for path in sorted(UI_CODE.rglob("*.py")):
        with path.open("rb") as source:
            for line, message, _comments, context in extract("python", source, keywords=PYTHON_KEYWORDS):
                found[(context, message)] = f"{path.relative_to(PROJECT_ROOT)}:{line}"
    return found


def untranslated(messages: dict) -> list[str]:
    catalogue = ja_catalogue()
    missing = []
    for (context, msgid), where in messages.items():
        entry = catalogue.get(msgid, context=context)
        strings = (entry.string if isinstance(entry.string, tuple) else (entry.string,)) if entry else ()
        if entry is None or entry.fuzzy or not strings or not all(strings):
            missing.append(f"{where}: {msgid!r}" + (f" (context {context!r})" if context else ""))
    return missing


def test_the_catalogue_reads_the_templates_strings():
    """The extraction itself works: a known string of each kind is found."""
    found = template_messages()
    assert (None, "Skip to main content") in found
    assert ("of a document", "Status") in found
    assert (None, ("%(counter)s passage", "%(counter)s passages")) in found
    assert (None, "Documents in %(name)s") in found
    from_code = ui_code_messages()
    assert (None, "Conversation renamed.") in from_code and (None, "the question is empty") in from_code
    assert (None, ("%(added)s of %(total)s file added.", "%(added)s of %(total)s files added.")) in from_code


def test_every_template_string_has_a_japanese_translation():
    assert untranslated(template_messages()) == []


def test_every_string_of_the_ui_code_has_a_japanese_translation():
    assert untranslated(ui_code_messages()) == []


def test_the_catalogue_is_consistent_and_not_fuzzy():
    catalogue = ja_catalogue()
    assert not catalogue.fuzzy, "the header is marked fuzzy: pybabel compile would skip the whole catalogue"
    assert catalogue.num_plurals == 1  # Japanese has one plural form
    # Babel's checks: the same %(name)s placeholders in each translation as in its msgid.
    problems = [(message.id, [str(error) for error in errors]) for message, errors in catalogue.check()]
    assert problems == []


def test_the_compiled_catalogue_holds_every_translation_of_the_po_file():
    with (CATALOGUE / "django.mo").open("rb") as mo:
        compiled = gettext.GNUTranslations(mo)
    stale = []
    for message in ja_catalogue():
        if not message.id or message.fuzzy or not message.string:
            continue
        if isinstance(message.id, tuple):
            singular, plural = message.id
            for count in (1, 2, 5):
                expected = message.string[compiled.plural(count)]
                got = (
                    compiled.npgettext(message.context, singular, plural, count)
                    if message.context
                    else compiled.ngettext(singular, plural, count)
                )
                if got != expected:
                    stale.append((message.id, count, got))
        else:
            got = compiled.pgettext(message.context, message.id) if message.context else compiled.gettext(message.id)
            if got != message.string:
                stale.append((message.id, got))
    assert stale == [], "django.mo is not the compiled django.po: run pybabel compile (docs/ui.md)"


@pytest.mark.parametrize("name", ["django.po", "django.mo"])
def test_the_catalogue_is_in_the_tree(name):
    """Both are committed: a fresh machine serves Japanese without compiling anything."""
    assert (CATALOGUE / name).stat().st_size > 0
