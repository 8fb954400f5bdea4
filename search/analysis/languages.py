"""Which language a text is in, by its scripts.

The product reads Japanese and English (and other languages PostgreSQL's configurations
analyse, as English is read: by spaces). Japanese is told apart by its scripts alone:
hiragana and katakana are Japanese's own, and kanji among Latin text is, for these users,
Japanese. A kanji or kana carries about a word where a Latin letter carries a fifth of one,
so a text is Japanese when its Japanese characters are at least a fifth as many as its
Latin letters: an English policy that names 東京 once stays English, a Japanese report full
of product names stays Japanese.
"""

from __future__ import annotations

JAPANESE = "ja"
ENGLISH = "en"
# What a collection may be set to; "auto" reads each chunk's (and each query's) language.
AUTO = "auto"
LANGUAGES = (AUTO, JAPANESE, ENGLISH)
JAPANESE_PER_LATIN_LETTER = 0.2


def is_japanese_char(char: str) -> bool:
    code = ord(char)
    return (
        0x3040 <= code <= 0x30FF  # hiragana, katakana
        or 0x31F0 <= code <= 0x31FF  # katakana phonetic extensions
        or 0x3400 <= code <= 0x4DBF  # CJK extension A
        or 0x4E00 <= code <= 0x9FFF  # CJK unified ideographs
        or 0xF900 <= code <= 0xFAFF  # CJK compatibility ideographs
        or 0xFF66 <= code <= 0xFF9F  # half-width katakana
        or 0x20000 <= code <= 0x2FA1F  # CJK extensions B and beyond
        or char in "々〆ヵヶ"
    )


def language_of(text: str, default: str = ENGLISH) -> str:
    """``ja`` or ``en`` (``default`` for a text with no letters of either)."""
    japanese = latin = 0
    for char in text:
        if char.isascii():
            latin += char.isalpha()
        elif is_japanese_char(char):
            japanese += 1
        elif char.isalpha():
            latin += 1
    if not japanese and not latin:
        return default
    return JAPANESE if japanese >= JAPANESE_PER_LATIN_LETTER * latin and japanese else ENGLISH
