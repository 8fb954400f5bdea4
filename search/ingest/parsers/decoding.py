"""Bytes to text for the text formats; binary data and text in no known encoding are a :class:`ParseError`.

Japanese files get their own steps, because charset-normalizer alone misreads them: it takes short
EUC-JP text for Korean (cp949), Shift_JIS with half-width katakana for Chinese (gb18030), and
ISO-2022-JP, being 7-bit, for UTF-8 text full of control characters. The characters decoded are
returned as written: nothing here changes full-width or half-width forms.
"""

from __future__ import annotations

import codecs
import functools
import re

from search.ingest.parsers.common import _CONTROL_RE, ParseError

# More than this share of control characters means "binary", not "text with a few oddities".
_MAX_CONTROL_RATIO = 0.05

_BOMS = (
    # UTF-32 before UTF-16: the UTF-32 LE BOM begins with the UTF-16 LE one.
    (b"\xef\xbb\xbf", "utf-8-sig", "utf-8-sig"),
    (b"\xff\xfe\x00\x00", "utf-32-le", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32-be", "utf-32"),
    (b"\xff\xfe", "utf-16-le", "utf-16"),
    (b"\xfe\xff", "utf-16-be", "utf-16"),
)
# Legacy encodings that charset-normalizer cannot tell apart on short Western text (it scores
# "café naïve" identically as cp1250, cp1252, cp1257...). cp1252 is by far the most common
# source of such files (it is what Windows and HTML treat "latin-1" as), so it wins ties.
_PREFERRED_LEGACY_ENCODINGS = ("cp1252", "latin_1", "iso8859_15")
_BINARY_REASON = "unsupported file type: binary data that is not PDF, DOCX or text (detected by content)"
# C0 control bytes other than tab, line breaks and ESC (ISO-2022 and terminal colours use it):
# bytes 0x80-0x9f are not counted, they are characters in Shift_JIS, EUC-JP and UTF-8.
_CONTROL_BYTES_RE = re.compile(rb"[\x01-\x08\x0b\x0e-\x1a\x1c-\x1f\x7f]")
_UNDECODABLE_REASON = "the text could not be decoded"
_SAVE_AS_UTF8 = "save the file as UTF-8 and upload it again"
# <meta charset>, <meta http-equiv="Content-Type" content="...; charset=...">, <?xml encoding="...">.
_META_CHARSET_RE = re.compile(
    rb"""<meta[^>]+charset\s*=\s*["']?\s*([a-zA-Z0-9_.:-]+)|<\?xml[^>]+encoding\s*=\s*["']([a-zA-Z0-9_.:-]+)""",
    re.IGNORECASE,
)

# --- Japanese ------------------------------------------------------------------------------------

# What people call "Shift_JIS" is Microsoft's superset (NEC and IBM extensions: ①, ㈱, 髙), and
# browsers decode every Shift_JIS label that way (WHATWG Encoding); Python's "shift_jis" lacks
# them. A declared Shift_JIS is therefore decoded as cp932.
_DECLARED_ALIASES = {
    label: "cp932"
    for label in ("shift_jis", "shift-jis", "sjis", "x-sjis", "ms_kanji", "csshiftjis", "windows-31j", "ms932")
}
# Legacy Japanese encodings tried on bytes that are not UTF-8: Shift_JIS (as Windows writes it),
# EUC-JP, then EUC-JP with JIS X 0213 (eucJP-ms files use its row 13: ①, ㈱).
_JAPANESE_CODECS = ("cp932", "euc_jp", "euc_jis_2004")
_CODEC_LABELS = {
    "utf-8": "UTF-8",
    "cp932": "Shift_JIS (CP932)",
    "euc_jp": "EUC-JP",
    "euc_jis_2004": "EUC-JP",
}
# ISO-2022-JP is 7-bit: its kanji are ASCII letters after an escape sequence that designates a
# character set. These designations (JIS X 0208, 0212, 0213, JIS X 0201 katakana and Roman, and
# ISO-2022-JP-2's GB2312, KS X 1001 and G2 sets) never occur in other text; ESC ( B (back to
# ASCII) alone is no evidence.
_ISO2022_JP_ESCAPE_RE = re.compile(rb"\x1b(?:\$[@AB]|\$\([CDOPQ]|\([IJ]|\.[AF])")
# Where Python's ISO-2022-JP and Windows decode a JIS X 0208 pair differently (〜 and ～ ...).
_JIS_TO_WINDOWS = str.maketrans("\u301c\u2016\u2212\u00a2\u00a3\u00ac", "\uff5e\u2225\uff0d\uffe0\uffe1\uffe2")
_ISO2022_JP_CODECS = ("iso2022_jp", "iso2022_jp_ext", "iso2022_jp_2", "iso2022_jp_2004", "iso2022_jp_3")
# Hiragana and full-width katakana: in no other language's text, so they are the evidence that
# a decoding is the right one. A Korean or Chinese file decoded as EUC-JP gives kanji, a Western
# or Chinese one decoded as Shift_JIS gives half-width katakana and rare kanji, never many kana.
_KANA_RE = re.compile("[\u3041-\u309f\u30a0-\u30ff]")
_CP932_NON_CHARACTER_RE = re.compile("[\uf8f0-\uf8f3]")
_HALF_WIDTH_KATAKANA_RE = re.compile("[\uff61-\uff9f]")
_NON_ASCII_RE = re.compile("[^\x00-\x7f]")
# Korean's most frequent syllables (charset-normalizer's table): a quarter or more of Korean text.
_FREQUENT_HANGUL = frozenset("이다에의는로하을가고지서한은기으년대사시를리도인스일")
_HANGUL_SYLLABLE_RE = re.compile("[\uac00-\ud7a3]")
_HANGUL_JAMO_RE = re.compile("[\u3131-\u318e]")
_MIN_FREQUENT_HANGUL_SHARE = 0.2
# Text whose kana are at least this share of its non-ASCII characters is Japanese: prose runs at
# 40-70 %, a CSV of names and notes at 15-20 %, a list of names and amounts at none (see below).
_MIN_KANA_SHARE = 0.1
# ... and whose common characters (below) are at least this share.
_MIN_COMMON_SHARE = 0.5
# Shift_JIS text without kana (a CSV of names and amounts, as Excel saves it) is recognised by
# its structure: nearly all of its characters are common ones, whose lead bytes 0x81-0x98 other
# encodings use for rare characters or none, and it is not valid EUC-JP. EUC-JP text without
# kana has the structure of EUC-KR and GB2312 text too: charset-normalizer decides it.
_MIN_COMMON_SHARE_WITHOUT_KANA = 0.9
_BESIDE_LETTERS_RE = re.compile("(?<=[A-Za-z])[^\x00-\x7f]|[^\x00-\x7f](?=[A-Za-z])")
_MAX_BESIDE_LETTERS_SHARE = 0.1
# A file that reads as Japanese up to an invalid byte is refused as such once it has this many
# kana there (a few kana come by chance from random bytes).
_NEAR_MISS_MIN_KANA = 4
# The statistics read this many characters; strict decoding has already checked the whole file.
_SAMPLE_CHARS = 200_000


@functools.cache
def _common_japanese_re() -> re.Pattern[str]:
    """Characters of JIS X 0208 rows 1-47 (symbols, full-width letters and digits, kana, Greek,
    Cyrillic, the 2,965 everyday kanji) and NEC row 13 (①, ㈱): Shift_JIS lead bytes 0x81-0x98."""
    characters = set()
    for lead in range(0x81, 0x99):
        for trail in (*range(0x40, 0x7F), *range(0x80, 0xFD)):
            try:
                characters.add(bytes((lead, trail)).decode("cp932"))
            except UnicodeDecodeError:
                continue
    return re.compile("[" + "".join(re.escape(character) for character in sorted(characters)) + "]")


def _japanese_shares(text: str) -> tuple[int, float, float]:
    """``(kana, kana share, common share)`` over the non-ASCII characters of ``text``'s start,
    half-width katakana left out: Japanese text may have many, but so has Chinese or EUC-JP
    decoded as Shift_JIS (its bytes 0xa1-0xdf are those characters there)."""
    sample = text[:_SAMPLE_CHARS]
    non_ascii = len(_NON_ASCII_RE.findall(sample)) - len(_HALF_WIDTH_KATAKANA_RE.findall(sample))
    if non_ascii <= 0:
        return 0, 0.0, 0.0
    kana = len(_KANA_RE.findall(sample))
    return kana, kana / non_ascii, len(_common_japanese_re().findall(sample)) / non_ascii


def _reads_as_korean(data: bytes) -> bool:
    """Whether bytes that decode as EUC-JP are rather Korean EUC-KR, which has the same byte
    structure and whose jamo (ㅋㅋ) become kana in EUC-JP. Korean text has more syllables than
    jamo, and many of them its most frequent ones; Japanese decoded as EUC-KR has its kana as
    jamo and its kanji as random syllables."""
    try:
        korean = data.decode("euc_kr")[:_SAMPLE_CHARS]
    except UnicodeDecodeError:
        return False
    syllables = _HANGUL_SYLLABLE_RE.findall(korean)
    if len(syllables) <= len(_HANGUL_JAMO_RE.findall(korean)):
        return False
    frequent = sum(1 for syllable in syllables if syllable in _FREQUENT_HANGUL)
    return frequent / len(syllables) >= _MIN_FREQUENT_HANGUL_SHARE


def _reads_as_japanese(shares: tuple[int, float, float]) -> bool:
    _, kana_share, common_share = shares
    return kana_share >= _MIN_KANA_SHARE and common_share >= _MIN_COMMON_SHARE


def _japanese_guess(data: bytes, decoded: dict[str, str | UnicodeDecodeError]) -> tuple[str, str] | None:
    """The legacy Japanese decoding of ``data`` that reads as Japanese, else None; ``decoded`` holds
    each of ``_JAPANESE_CODECS``' strict decoding of it, or its error. With kana in more than one
    (rare: the encodings share few byte sequences), the one with the most kana wins."""
    best: tuple[int, str, str] | None = None
    for codec, text in decoded.items():
        if isinstance(text, str):
            shares = _japanese_shares(text)
            if _reads_as_japanese(shares) and (best is None or shares[0] > best[0]):
                best = (shares[0], text, codec)
    if best is not None and not (best[2] != "cp932" and _reads_as_korean(data)):
        return best[1], best[2]
    # No kana: Shift_JIS by its structure (see _MIN_COMMON_SHARE_WITHOUT_KANA).
    shift_jis = decoded["cp932"]
    if isinstance(shift_jis, str) and not any(isinstance(decoded[codec], str) for codec in ("euc_jp", "euc_jis_2004")):
        _, _, common_share = _japanese_shares(shift_jis)
        sample = shift_jis[:_SAMPLE_CHARS]
        # Western cp1252 text with curly quotes also decodes as Shift_JIS ("Don’t" as "Don稚"), but
        # each such kanji stands against the letters of a word; a Japanese word does not.
        against_letters = len(_BESIDE_LETTERS_RE.findall(sample)) / max(1, len(_NON_ASCII_RE.findall(sample)))
        if common_share >= _MIN_COMMON_SHARE_WITHOUT_KANA and against_letters <= _MAX_BESIDE_LETTERS_SHARE:
            return shift_jis, "cp932"
    return None


def _decode_strict(data: bytes, codec: str) -> str:
    """``data.decode(codec)``, except that Python's cp932 also decodes the single bytes 0xa0 and
    0xfd-0xff, which are no Shift_JIS character, to private-use U+F8F0-U+F8F3: those are errors."""
    text = data.decode(codec)
    if codecs.lookup(codec).name == "cp932":
        bad = _CP932_NON_CHARACTER_RE.search(text)
        if bad is not None:
            start = len(text[: bad.start()].encode("cp932"))
            raise UnicodeDecodeError(codec, data, start, start + 1, "not a Shift_JIS character")
    return text


def _bad_bytes(data: bytes, error: UnicodeDecodeError) -> str:
    """Where decoding failed, as the user's hex editor shows it: ``byte 20 (0xff)``."""
    bad = " ".join(f"0x{byte:02x}" for byte in data[error.start : max(error.end, error.start + 1)][:4])
    return f"byte {error.start} ({bad})"


def _undecodable(codec: str, data: bytes, error: UnicodeDecodeError) -> ParseError:
    label = _CODEC_LABELS[codec]
    return ParseError(
        f"{_UNDECODABLE_REASON}: it reads as {label} but {_bad_bytes(data, error)} is not valid {label}; "
        f"{_SAVE_AS_UTF8}"
    )


def _near_miss(data: bytes, errors: dict[str, UnicodeDecodeError]) -> ParseError | None:
    """A refusal naming the encoding the file is written in, when it reads as Japanese in it up to
    a byte that is not valid there (a damaged file, or two encodings in one): such a file must
    fail rather than be decoded whole, wrongly, by a guess. The furthest such encoding wins."""
    furthest: tuple[int, str] | None = None
    for codec, error in errors.items():
        if furthest is not None and error.start <= furthest[0]:
            continue
        shares = _japanese_shares(data[: error.start].decode(codec, errors="ignore"))
        if shares[0] >= _NEAR_MISS_MIN_KANA and _reads_as_japanese(shares):
            furthest = (error.start, codec)
    return None if furthest is None else _undecodable(furthest[1], data, errors[furthest[1]])


@functools.cache
def _windows_only_jis_pairs() -> dict[bytes, str]:
    """The JIS pairs that Python's ISO-2022-JP refuses and Windows decodes (the NEC and IBM rows),
    each with its character: the pair's Shift_JIS bytes decoded as cp932."""
    table = {}
    for row in range(0x21, 0x7F):
        for cell in range(0x21, 0x7F):
            pair = bytes((row, cell))
            lead = (row + 1) // 2 + (0x70 if row <= 0x5E else 0xB0)
            trail = cell + (0x7E if row % 2 == 0 else 0x1F if cell <= 0x5F else 0x20)
            try:
                character = _decode_strict(bytes((lead, trail)), "cp932")
            except UnicodeDecodeError:
                continue
            try:
                (b"\x1b$B" + pair).decode("iso2022_jp")
            except UnicodeDecodeError:
                table[pair] = character
    return table


def _windows_jis_pair(error: UnicodeDecodeError) -> tuple[str, int]:
    """Codec error handler: a JIS pair of the NEC or IBM rows, as Windows decodes it."""
    character = None
    if error.end - error.start == 2:
        character = _windows_only_jis_pairs().get(error.object[error.start : error.end])
    if character is None:
        raise error
    return character, error.end


codecs.register_error("ragsite-windows-jis", _windows_jis_pair)


def _iso2022_jp_microsoft(data: bytes) -> str:
    """ISO-2022-JP as Windows writes it (CP50220/CP50221): Python's codec (with half-width
    katakana), given the NEC and IBM rows (①, ㈱, 髙) it refuses by an error handler, and its six
    differences from Windows mapped. Raises UnicodeDecodeError for anything else."""
    return data.decode("iso2022_jp_ext", errors="ragsite-windows-jis").translate(_JIS_TO_WINDOWS)


def _decode_iso2022_jp(data: bytes) -> tuple[str, str]:
    """Bytes with ISO-2022-JP escape sequences: the first codec that decodes them (the plain one
    first, then its extensions, then Windows'), else a ParseError naming where plain ISO-2022-JP
    failed."""
    error = None
    for codec in _ISO2022_JP_CODECS:
        try:
            return data.decode(codec), codec
        except UnicodeDecodeError as exc:
            error = error or exc
    try:
        return _iso2022_jp_microsoft(data), "cp50221"
    except UnicodeDecodeError:
        pass
    raise ParseError(
        f"{_UNDECODABLE_REASON}: it has ISO-2022-JP escape sequences but {_bad_bytes(data, error)} is not "
        f"valid ISO-2022-JP; {_SAVE_AS_UTF8}"
    )


# --- any text ------------------------------------------------------------------------------------


def _check_plausible_text(text: str) -> None:
    if "\x00" in text:
        raise ParseError(f"{_BINARY_REASON}: it contains NUL bytes")
    # Form feeds are normal in text files (page breaks); vertical tabs are not.
    controls = len(_CONTROL_RE.findall(text)) + text.count("\x0b")
    if text and controls / len(text) > _MAX_CONTROL_RATIO:
        raise ParseError(f"{_BINARY_REASON}: too many control characters")


def _charset_normalizer_guess(data: bytes) -> tuple[str, str] | None:
    from charset_normalizer import from_bytes

    matches = from_bytes(data)
    best = matches.best()
    if best is None:
        return None
    chosen = best
    for match in matches:
        tied = match.chaos <= best.chaos and match.coherence >= best.coherence - 0.02
        if tied and match.encoding in _PREFERRED_LEGACY_ENCODINGS:
            chosen = match
            break
    return str(chosen), chosen.encoding


def _declared_decode(data: bytes, declared: str) -> tuple[str, str] | None:
    codec = _DECLARED_ALIASES.get(declared.lower(), declared)
    try:
        return _decode_strict(data, codec), codec.lower()
    except (LookupError, UnicodeDecodeError):  # unknown names, and bytes->bytes codecs
        return None


def _decode_legacy(data: bytes, utf8_error: UnicodeDecodeError, declared: str | None) -> tuple[str, str]:
    """Bytes that are not UTF-8: the declared encoding, Shift_JIS or EUC-JP that reads as
    Japanese, a refusal for what reads as Japanese up to an invalid byte, charset-normalizer's
    guess, else a refusal: binary data, or text in an encoding that is not known."""
    decoded = _declared_decode(data, declared) if declared else None
    if decoded is not None:
        return decoded
    attempts: dict[str, str | UnicodeDecodeError] = {}
    for codec in _JAPANESE_CODECS:
        try:
            attempts[codec] = _decode_strict(data, codec)
        except UnicodeDecodeError as exc:
            attempts[codec] = exc
    decoded = _japanese_guess(data, attempts)
    if decoded is not None:
        return decoded
    # Text in any ASCII-compatible encoding has next to no control bytes; binary data has many.
    text_like = len(_CONTROL_BYTES_RE.findall(data)) / len(data) <= _MAX_CONTROL_RATIO
    if text_like:
        errors = {"utf-8": utf8_error} | {
            codec: error for codec, error in attempts.items() if not isinstance(error, str)
        }
        refusal = _near_miss(data, errors)
        if refusal is not None:
            raise refusal
    decoded = _charset_normalizer_guess(data)
    if decoded is not None:
        return decoded
    if not text_like:
        raise ParseError(_BINARY_REASON)
    if _NON_ASCII_RE.search(data[: utf8_error.start].decode("utf-8")):
        # Multi-byte UTF-8 sequences do not occur by chance: the file was UTF-8 up to there.
        raise _undecodable("utf-8", data, utf8_error)
    raise ParseError(
        f"{_UNDECODABLE_REASON}: it is not valid UTF-8, Shift_JIS (CP932), EUC-JP or ISO-2022-JP, and no other "
        f"encoding fits it; {_SAVE_AS_UTF8}"
    )


def _decode_text(data: bytes, *, declared: str | None = None) -> tuple[str, str]:
    """Decode text bytes; returns ``(text, encoding)`` or raises ParseError for binary data and
    for text in no known encoding (the message names the encoding and the byte at fault when
    the file reads as that encoding up to there).

    Order: a byte-order mark, ISO-2022-JP escape sequences in 7-bit data, strict UTF-8, an
    encoding the document declares (HTML ``<meta charset>``, an XML declaration), Shift_JIS or
    EUC-JP when the result reads as Japanese, then charset-normalizer's best guess.
    """
    for bom, codec, label in _BOMS:
        if data.startswith(bom):
            try:
                text = data[len(bom) :].decode(codec)
            except UnicodeDecodeError as exc:
                raise ParseError(f"the file starts with a {label} byte-order mark but is not valid {label}") from exc
            _check_plausible_text(text)
            return text, codec
    # Without a BOM, NUL bytes mean binary (BOM-less UTF-16 is too rare to be worth guessing).
    if b"\x00" in data:
        raise ParseError(f"{_BINARY_REASON}: it contains NUL bytes")
    if data.isascii() and _ISO2022_JP_ESCAPE_RE.search(data):
        # Before UTF-8: ISO-2022-JP is valid (7-bit) UTF-8, with its escape sequences as controls.
        decoded = _decode_iso2022_jp(data)
    else:
        utf8_error = None
        try:
            decoded = data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError as exc:
            utf8_error = exc
        if utf8_error is not None:  # outside the except: a refusal is not "during" the decoding error
            decoded = _decode_legacy(data, utf8_error, declared)
    _check_plausible_text(decoded[0])
    return decoded


def _declared_html_charset(data: bytes) -> str | None:
    """The charset an HTML (or XML) document declares near its start, if any."""
    match = _META_CHARSET_RE.search(data[:4096])
    if match is None:
        return None
    return (match.group(1) or match.group(2)).decode("ascii")
