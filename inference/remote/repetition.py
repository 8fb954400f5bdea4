"""A stream-side detector of generations that repeat themselves (docs/routing.md,
"Generations that repeat themselves").

``RepetitionGuard.feed(delta)`` takes each text delta of a generation as it arrives and
returns a ``Repetition`` once the text's tail is one unit repeated, by these rules (the unit
is the shortest string whose repetition the tail is, found by its periodicity):

- ``span``: a unit of at least ``span_chars`` characters or ``span_words`` words, repeated
  ``repeats`` times in a row (a sentence or a paragraph said three times);
- ``line``: whole lines of at least ``line_words`` words and ``line_chars`` characters other
  than spaces, repeated ``repeats`` times (a short line said three times; not a table row,
  nor ``}`` or ``end`` of code, which are shorter);
- ``phrase``: a unit on one line of at least ``phrase_chars`` characters and ``phrase_words``
  words, repeated ``phrase_repeats`` times in a row (``600-kg (1,320-kg) 600-kg (1,320-kg) ...``);
- ``digits``: digits repeated over ``digit_run_chars`` characters (``1000000000000...``);
- ``blank``: blank lines over ``blank_run_chars`` characters (a model that emits newlines
  until ``max_tokens``);
- ``short``: any other unit over ``short_run_chars`` characters (``ha ha ha ...``,
  ``-----...``, ``[1][1][1]...``);
- ``counted``: ``counted_repeats`` lines in a row that are the same but for their numbers
  (a model counting on: ``7. Minimum length: 40``, ``8. Minimum length: 48``, ...).

Legitimate text rarely repeats itself exactly and consecutively: the items of a numbered
list differ by their numbers and content, table rows by their cells, a quoted sentence
comes twice at most; so only consecutive exact copies count, and short units must fill far
more than three copies' worth.

Cost: a delta is appended to a list; every ``check_every_chars`` characters the last
``max_period_chars`` + 12 characters are searched (``str.rfind``, in C) for earlier
occurrences of the last 12, each of which is a candidate period, verified by one string
comparison. A few microseconds per check on ordinary text, whatever its length (only a
window of the tail is kept).

What the stored answer keeps: ``Repetition.cut_at_char`` is the length of the text to keep,
``text[:cut_at_char]``: everything before the repeated run and its first copy (extended to
the end of its word or its closing punctuation, trailing whitespace dropped). The text
already streamed to readers cannot be unsent; ``trim_repetition(text, stats)`` applies the
cut recorded in a generation's stats (``stats["repetition"]``), idempotently.

No Django import (``inference.remote`` is a plain client).
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, replace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Thresholds:
    span_chars: int = 30  # about 6 words: shorter units are common inside legitimate text
    span_words: int = 8
    repeats: int = 3  # a quoted sentence may come twice; a third copy in a row is a loop
    line_words: int = 3
    line_chars: int = 12
    # ``phrase``: a few words said four times running (no list, table or prose does that; a
    # fifth copy is not waited for, since a check every 16 characters may miss a run that ends).
    phrase_chars: int = 15
    phrase_words: int = 3
    phrase_repeats: int = 4
    digit_run_chars: int = 40  # longer than any real number (10^12 has 12 zeros)
    blank_run_chars: int = 64
    short_run_chars: int = 200  # ~50 tokens: above separators (80 '=') and wide table rules
    max_period_chars: int = 400  # longer units are not looked for
    check_every_chars: int = 16  # detection lags the loop by at most this (plus one delta)
    # ``counted``: lines that are the same but for their numbers ("7. Minimum password length: 40
    # characters." then 8., 9., ...), this many in a row: a list item may share its wording with the
    # next two, a model that counts on has lost its way.
    counted_repeats: int = 4
    counted_words: int = 2
    counted_chars: int = 8


THRESHOLDS = Thresholds()

# The tail's last NEEDLE characters are searched for earlier: each occurrence is a candidate
# period. At most MAX_CANDIDATES are verified per check (the nearest first).
NEEDLE = 12
MAX_CANDIDATES = 64
# Characters that may end the kept copy (besides whitespace).
_CLOSING = frozenset(".!?,;:)]}")
_WORD = re.compile(r"\w+")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Repetition:
    """Where a generation's loop is, in characters of its text (all its deltas joined)."""

    cut_at_char: int  # keep text[:cut_at_char]: what came before the loop, and its first copy
    start_char: int  # where the repeated run begins
    period: int  # characters of the repeated unit
    repeats: int  # full copies of it in the tail when detected
    rule: str  # span, line, phrase, digits, blank, short or counted (the module's docstring)
    chars_seen: int  # characters fed when it was detected

    def as_dict(self) -> dict:
        return asdict(self)


class RepetitionGuard:
    """Feed it every text delta of one generation, in order; ``feed`` returns the
    ``Repetition`` from the delta on which the tail became a loop (and the same afterwards),
    else None. Never raises: a failure of the guard itself stops the watching (logged)."""

    def __init__(self, thresholds: Thresholds = THRESHOLDS):
        self.thresholds = thresholds
        self.found: Repetition | None = None
        self.chars = 0  # fed so far
        self._tail = ""  # the last characters fed, at most _window
        self._offset = 0  # characters dropped before _tail
        self._pending: list[str] = []
        self._unchecked = 0
        self._window = 4 * thresholds.max_period_chars + thresholds.short_run_chars + 1024
        self._failed = False

    def feed(self, text: str) -> Repetition | None:
        if self.found is not None or self._failed or not text:
            return self.found
        self._pending.append(text)
        self.chars += len(text)
        self._unchecked += len(text)
        if self._unchecked >= self.thresholds.check_every_chars:
            try:
                self.found = self._check()
            except Exception:
                self._failed = True
                logger.exception("the repetition guard failed: this generation is no longer watched")
        return self.found

    # ------------------------------------------------------------------ the check

    def _check(self) -> Repetition | None:
        self._unchecked = 0
        tail = self._tail + "".join(self._pending)
        self._pending.clear()
        if len(tail) > self._window:
            drop = len(tail) - self._window
            tail, self._offset = tail[drop:], self._offset + drop
        self._tail = tail
        found = self._periodic(tail) or self._counted_lines(tail)
        if found is None and _DIGITS.search(tail):
            # The same again with every number masked: paragraphs that repeat but for a counter
            # ("3. What does she do? ..." then "4. What does she do? ..."); spans only, and
            # counted_repeats copies of them, as for lines.
            masked, origin = _masked(tail)
            loop = self._periodic(masked, spans_only=True)
            if loop is not None:
                start, cut = loop.start_char - self._offset, loop.cut_at_char - self._offset
                found = replace(
                    loop,
                    start_char=self._offset + origin[start],
                    cut_at_char=self._offset + (origin[cut] if cut < len(origin) else len(tail)),
                    period=origin[min(start + loop.period, len(origin) - 1)] - origin[start],
                    rule="counted",
                    chars_seen=self._offset + len(tail),
                )
        return found

    def _periodic(self, tail: str, *, spans_only: bool = False) -> Repetition | None:
        """The tail's loop by the period rules (span, line, phrase, digits, blank, short), if any."""
        n = len(tail)
        if n <= NEEDLE:
            return None
        needle = tail[n - NEEDLE :]
        low = max(0, n - NEEDLE - self.thresholds.max_period_chars)
        end = n - 1  # an occurrence ending before the last character: period >= 1
        for _ in range(MAX_CANDIDATES):
            at = tail.rfind(needle, low, end)
            if at < 0:
                return None
            end = at + NEEDLE - 1  # the next one starts before this one
            found = self._loop_of_period(tail, n - NEEDLE - at)
            if found is not None and (
                not spans_only or (found.rule == "span" and found.repeats >= self.thresholds.counted_repeats)
            ):
                return found
        return None

    def _counted_lines(self, tail: str) -> Repetition | None:
        """The ``counted`` rule: the last complete lines the same once their numbers are
        masked, ``counted_repeats`` of them in a row; the first of them is kept."""
        t = self.thresholds
        ends = [m.start() for m in re.finditer("\n", tail)]
        if len(ends) < t.counted_repeats:
            return None
        starts = [0, *(end + 1 for end in ends[:-1])]
        lines = [(start, end) for start, end in zip(starts, ends, strict=True) if tail[start:end].strip()]
        if len(lines) < t.counted_repeats:
            return None
        masked = [_DIGITS.sub("#", tail[start:end]).strip() for start, end in lines]
        last = masked[-1]
        if len(_WORD.findall(_DIGITS.sub("", last))) < t.counted_words or len("".join(last.split())) < t.counted_chars:
            return None
        if last.startswith("|") or _DIGITS.search(tail[lines[-1][0] : lines[-1][1]]) is None:
            return None  # table rows may repeat; lines without numbers are the exact rules' to judge
        same = 0
        while same < len(masked) and masked[-1 - same] == last:
            same += 1
        if same < t.counted_repeats:
            return None
        first_start, first_end = lines[-same]
        return Repetition(
            cut_at_char=self._offset + first_end,
            start_char=self._offset + first_start,
            period=first_end + 1 - first_start,
            repeats=same,
            rule="counted",
            chars_seen=self._offset + len(tail),
        )

    def _loop_of_period(self, tail: str, period: int) -> Repetition | None:
        """The loop when the tail repeats its last ``period`` characters enough for a rule."""
        n = len(tail)
        unit = tail[n - period :]
        if (unit + unit).find(unit, 1) < period:
            return None  # a repetition of a shorter unit: that one is the candidate to judge
        rule, needed = self._rule(unit)
        if needed > n:
            return None
        run = tail[n - needed :]
        if run[period:] != run[:-period]:
            return None
        start = n - needed
        while start > 0 and tail[start - 1] == tail[start - 1 + period]:
            start -= 1
        cut = self._cut(tail, start, period)
        return Repetition(
            cut_at_char=self._offset + cut,
            start_char=self._offset + start,
            period=period,
            repeats=(n - start) // period,
            rule=rule,
            chars_seen=self._offset + n,
        )

    def _rule(self, unit: str) -> tuple[str, int]:
        """The rule a unit falls under, and how many characters of the tail it must fill."""
        t = self.thresholds
        period = len(unit)
        copies = t.repeats * period
        # Counted on the rotation that starts after a whitespace, so that no word is split.
        space = max(unit.rfind(" "), unit.rfind("\n"), unit.rfind("\t"))
        words = len(_WORD.findall(unit[space + 1 :] + unit[: space + 1]))
        if period >= t.span_chars or words >= t.span_words:
            return "span", copies
        if "\n" in unit:
            if unit.isspace():
                return "blank", max(t.blank_run_chars, copies)
            line = unit[unit.rfind("\n") + 1 :] + unit[: unit.rfind("\n") + 1]  # whole lines
            content = line.strip()
            if (
                words >= t.line_words
                and len("".join(content.split())) >= t.line_chars
                and not content.startswith("|")  # a table's rows may repeat
            ):
                return "line", copies
        elif period >= t.phrase_chars and words >= t.phrase_words:
            return "phrase", t.phrase_repeats * period
        if unit.isdigit():
            return "digits", max(t.digit_run_chars, copies)
        return "short", max(t.short_run_chars, copies)

    @staticmethod
    def _cut(tail: str, start: int, period: int) -> int:
        """Where the kept text ends: after the first copy of the unit from ``start``, moved on
        (less than a period) to the end of its word or its closing punctuation, since the run
        may begin inside the sentence before the loop when it ends like the unit; trailing
        whitespace dropped."""
        n = len(tail)
        first_end = start + period
        cut = first_end
        for c in range(first_end, min(first_end + period, n + 1)):
            if c == n or tail[c - 1].isspace() or tail[c - 1] in _CLOSING or tail[c].isspace():
                cut = c
                break
        while cut > 0 and tail[cut - 1].isspace():
            cut -= 1
        return cut


def _masked(text: str) -> tuple[str, list[int]]:
    """``text`` with every run of digits as one ``#``, and for each of its characters the
    index in ``text`` of the character it stands for."""
    masked, origin, position = [], [], 0
    for match in _DIGITS.finditer(text):
        masked.append(text[position : match.start()])
        origin.extend(range(position, match.start()))
        masked.append("#")
        origin.append(match.start())
        position = match.end()
    masked.append(text[position:])
    origin.extend(range(position, len(text)))
    return "".join(masked), origin


def trim_repetition(text: str, stats: dict | None) -> str:
    """``text`` as an answer should store it: ``text[:cut_at_char]`` when ``stats`` (a
    generation's stats, as its ``stats`` event and result carry them) record a repetition
    cut, else unchanged. Idempotent: trimming trimmed text changes nothing."""
    repetition = stats.get("repetition") if isinstance(stats, dict) else None
    cut = repetition.get("cut_at_char") if isinstance(repetition, dict) else None
    if isinstance(cut, int) and not isinstance(cut, bool) and 0 <= cut < len(text):
        return text[:cut]
    return text
