"""``manage.py eval_answers FILE.jsonl``: answer quality through the real answer path.

Each line of the file is one question: ``{"id", "question", "expected": [regex, ...],
"sources": [file name, ...], "kind": "single" | "two_facts" | "two_documents" |
"unanswerable"}``. Every question is asked with ``answer_create`` (as the UI and both APIs
do), one at a time, and waited for: the running system's workers (``manage.py up``)
retrieve, generate and verify it. Judged per answer:

- correct: every ``expected`` pattern matches the text (case-insensitive); an unanswerable
  question is correct when the answer abstained;
- right source: every expected file is among the documents the answer cites;
- citation validity: the share of the text's citation markers that name a source the prompt
  gave, of the stored text and of the text as generated (before verification);
- abstention: unanswerable questions declined, and answerable ones declined wrongly;
- how many generated answers said nothing their sources support and were answered with the
  sources' own sentences instead (``quoted_instead``: their mode is ``extractive``);
- grounded share, how each generation ended (repetition, max_tokens), latency, the engine's
  acceptance figures.

The same figures of the text as generated (before verification) are printed beside
(``unverified``). The last line printed is one JSON object. docs/answers.md.

A file of reading-comprehension answers, ``{"id", "question", "answers": [...], "doc"}`` (as
``../shared/data/jsquad-ja/answers.jsonl``), is read too: an answer is correct when it holds
any listed answer, and its source is right when it cites ``doc``. Beside a BEIR corpus
(``corpus.jsonl`` in the same folder) the corpus is ingested into the workspace first, as
``eval_retrieval`` does. Text is compared after NFKC (full-width and half-width forms alike).
``--half even|odd`` asks every other question only: tune on one half, report on the other.

``--removed-source`` asks each answerable question a second time with its own source documents
left out of retrieval (``answer_create(documents_excluded=...)``), the rest of the collection
kept: a plausible unanswerable question built from data nobody wrote for it (its neighbours
from the same article or handbook stay, and look as if they answer). Only a question whose
answer no other searched document holds counts (``removed_source_questions``; the others are
``removed_source_skipped``: the answer may still be there, and declining it would be wrong);
``removed_source_declined`` is the share of those the answer declined.

``--halves`` asks both halves and ``--held-out FILE`` a second file; either way the last line
is ``{"tuned": ..., "held_out": ..., "gap": ...}``: the even half (or FILE) is what the rules
were tuned on, the odd half (or the held-out file) what nobody tuned for, and ``gap`` is
held-out less tuned for each share (docs/answers.md, "Questions nobody tuned for").
"""

from __future__ import annotations

import json
import re
import statistics
import time
import unicodedata
from pathlib import Path

from django.core.management.base import CommandError

from ragsite.commands import DatabaseCommand
from search import bulk_load as bulk
from search.answering.answers import answer_create
from search.answering.prompting import citation_markers
from search.beir import is_beir_dir
from search.models import Answer, Chunk, Collection, Document, Workspace
from search.services import workspace_create

KINDS = ("single", "two_facts", "two_documents", "unanswerable")
# The shares a held-out set is compared on with its tuned one (``gap``: held-out less tuned).
COMPARED = (
    "correct",
    "right_source",
    "citation_validity",
    "unanswerable_declined",
    "answerable_declined",
    "removed_source_declined",
)


def qa_read(path: Path) -> list[dict]:
    """The questions of a QA file, checked: a malformed line is refused with its number."""
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CommandError(f"{path}:{number}: not JSON ({exc})") from None
        if "answers" in item and "expected" not in item:  # reading comprehension: any listed span
            item = {
                "id": item.get("id"),
                "question": item.get("question"),
                "answers": item["answers"],
                "expected": [],
                "sources": [item["doc"]] if item.get("doc") else [],
                "kind": "single",
            }
            if not item["answers"] or not all(isinstance(a, str) and a for a in item["answers"]):
                raise CommandError(f"{path}:{number}: answers must be a list of non-empty strings")
        missing = [
            key for key in ("id", "question", "expected", "sources", "kind") if key not in item or item[key] is None
        ]
        if missing:
            raise CommandError(f"{path}:{number}: missing {', '.join(missing)}")
        if item["kind"] not in KINDS:
            raise CommandError(f"{path}:{number}: kind {item['kind']!r} is not one of {', '.join(KINDS)}")
        try:
            item["patterns"] = [re.compile(_nfkc(pattern), re.IGNORECASE) for pattern in item["expected"]]
        except re.error as exc:
            raise CommandError(f"{path}:{number}: a pattern does not compile ({exc})") from None
        items.append(item)
    if not items:
        raise CommandError(f"{path} holds no question")
    return items


def _nfkc(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 1)
    return round(statistics.quantiles(sorted(values), n=100, method="inclusive")[q - 1], 1)


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def _share(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 4) if flags else None


def judge(item: dict, answer: Answer, files_by_document: dict[int, str]) -> dict:
    """One answer's verdicts (see the module docstring)."""
    given = {source["number"]: source for source in answer.sources}
    original = answer.verification.get("original_text", answer.text) if answer.verification else answer.text

    def cited_files(text: str) -> set[str]:
        numbers = {n for marker in citation_markers(text) for n in marker.numbers if n in given}
        return {files_by_document.get(given[n]["document_id"], "") for n in numbers}

    def validity(text: str) -> tuple[int, int]:
        numbers = [n for marker in citation_markers(text) for n in marker.numbers]
        return sum(n in given for n in numbers), len(numbers)

    answerable = item["kind"] != "unanswerable"
    verdict = {
        "id": item["id"],
        "kind": item["kind"],
        "status": answer.status,
        "mode": answer.mode,
        "abstained": answer.abstained,
        "grounded": answer.grounded,
        "finish_reason": (answer.stats or {}).get("finish_reason"),
        "total_ms": (answer.timings or {}).get("total_ms"),
        "speculative": (answer.stats or {}).get("speculative"),
        "quoted_instead": "quoted_instead" in (answer.stats or {}),
    }
    for name, text, abstained in (("", answer.text, answer.abstained), ("unverified_", original, False)):
        if answerable:
            compared = _nfkc(text)
            if "answers" in item:
                held = any(_nfkc(expected) in compared for expected in item["answers"])
            else:
                held = all(p.search(compared) for p in item["patterns"])
            correct = answer.status == Answer.Status.DONE and held
            # An answer that declined cites no source for the answer: its list of closest passages is not one.
            right_source = not abstained and set(item["sources"]) <= cited_files(text)
        else:
            # Unverified, a decline is only what the model itself wrote.
            correct = abstained or bool(answer.verification.get("declined") and not name)
            right_source = None
        valid, markers = validity(text)
        verdict.update({f"{name}correct": correct, f"{name}right_source": right_source})
        verdict.update({f"{name}valid_markers": valid, f"{name}markers": markers})
    return verdict


def summarise(verdicts: list[dict], model: str) -> dict:
    answerable = [v for v in verdicts if v["kind"] != "unanswerable"]
    unanswerable = [v for v in verdicts if v["kind"] == "unanswerable"]
    latencies = [v["total_ms"] for v in verdicts if v["total_ms"] is not None]
    speculative = [v["speculative"] for v in verdicts if v["speculative"]]
    removed = [v["removed_source_abstained"] for v in answerable if v.get("removed_source_abstained") is not None]
    summary = {"model": model, "questions": len(verdicts), "answerable": len(answerable)}
    for name in ("", "unverified_"):
        markers = sum(v[f"{name}markers"] for v in verdicts)
        summary[f"{name}correct"] = _share([v[f"{name}correct"] for v in answerable])
        summary[f"{name}right_source"] = _share([v[f"{name}right_source"] for v in answerable])
        summary[f"{name}citation_validity"] = (
            round(sum(v[f"{name}valid_markers"] for v in verdicts) / markers, 4) if markers else None
        )
    summary.update(
        {
            "unanswerable_declined": _share([v["abstained"] for v in unanswerable]),
            "answerable_declined": _share([v["abstained"] for v in answerable]),
            **(
                {
                    "removed_source_questions": len(removed),
                    "removed_source_declined": _share(removed),
                    "removed_source_skipped": sum(v.get("removed_source_skipped", False) for v in answerable),
                }
                if any("removed_source_abstained" in v for v in answerable)
                else {}
            ),
            "grounded": _mean([v["grounded"] for v in verdicts if v["grounded"] is not None]),
            "failed": sum(v["status"] != Answer.Status.DONE for v in verdicts),
            # Generated answers with nothing supported, answered with the sources' sentences.
            "quoted_instead": sum(v["quoted_instead"] for v in verdicts),
            "ended_by_repetition": sum(v["finish_reason"] == "repetition" for v in verdicts),
            "ended_at_max_tokens": sum(v["finish_reason"] == "length" for v in verdicts),
            "latency_p50_ms": _percentile(latencies, 50),
            "latency_p99_ms": _percentile(latencies, 99),
            "draft_acceptance_mean": _mean(
                [s["draft_accepted"] for s in speculative if s.get("draft_accepted") is not None]
            ),
            "mean_acceptance_length": _mean(
                [s["mean_acceptance_length"] for s in speculative if s.get("mean_acceptance_length") is not None]
            ),
            "modes": {mode: sum(v["mode"] == mode for v in verdicts) for mode in sorted({v["mode"] for v in verdicts})},
        }
    )
    return summary


class Command(DatabaseCommand):
    help = "Ask a QA set's questions through the answer path and print answer quality (last line: JSON)."

    def add_arguments(self, parser):
        parser.add_argument("file", type=Path)
        parser.add_argument("--workspace", default="demo", help="The workspace's slug (default: demo).")
        parser.add_argument("--collection", action="append", help="A collection's name (repeatable; default: all).")
        parser.add_argument("--route", default=None, help="A route's name (default: the default route).")
        parser.add_argument("--timeout", type=float, default=300.0, help="Seconds to wait for one answer.")
        parser.add_argument("--limit", type=int, default=None, help="Only the first N questions.")
        parser.add_argument(
            "--half",
            choices=("even", "odd"),
            default=None,
            help="Every other question: the 0th, 2nd... or the 1st, 3rd...",
        )
        parser.add_argument(
            "--removed-source",
            action="store_true",
            help="Ask each answerable question again with its own source documents left out: it should decline.",
        )
        compared = parser.add_mutually_exclusive_group()
        compared.add_argument(
            "--halves", action="store_true", help="Ask both halves: the even one tuned on, the odd one held out."
        )
        compared.add_argument(
            "--held-out", type=Path, default=None, help="A second QA file nobody tuned for, reported beside FILE."
        )

    def handle(self, *args, **options):
        for path in (options["file"], options["held_out"]):
            if path is not None and not path.is_file():
                raise CommandError(f"{path} is not a file")
        if options["half"] and (options["halves"] or options["held_out"]):
            raise CommandError("--half asks one half; --halves and --held-out compare two sets")
        items = qa_read(options["file"])
        held_out = qa_read(options["held_out"]) if options["held_out"] else None
        if options["half"]:
            items = items[(options["half"] == "odd") :: 2]
        elif options["halves"]:
            items, held_out = items[0::2], items[1::2]
        limit = options["limit"]
        corpus = options["file"].parent
        if is_beir_dir(corpus):  # a reading-comprehension set beside its corpus: asked over it
            workspace = workspace_create(name=options["workspace"].title(), slug=options["workspace"])
            collection = bulk.beir_collection_ingested(workspace, corpus, log=self.stderr.write)
            options["collection"] = [collection.name]
        workspace = Workspace.objects.filter(slug=options["workspace"]).first()
        if workspace is None:
            raise CommandError(f"no workspace {options['workspace']!r} (manage.py up loads the demo one)")
        collections = None
        if options["collection"]:
            collections = list(Collection.objects.filter(workspace=workspace, name__in=options["collection"]))
            if len(collections) != len(set(options["collection"])):
                raise CommandError(f"not every collection of {options['collection']} is in {workspace.slug!r}")
        asking = _Asking(self, workspace, collections, options["route"], options["timeout"], options["removed_source"])
        if held_out is None:
            self.stdout.write(json.dumps(asking.summary(items[:limit]), ensure_ascii=False))
            return
        tuned = asking.summary(items[:limit])
        self.stdout.write(json.dumps({"tuned": tuned}, ensure_ascii=False))
        held = asking.summary(held_out[:limit])
        self.stdout.write(json.dumps({"held_out": held}, ensure_ascii=False))
        gap = {
            key: round(held[key] - tuned[key], 4)
            for key in COMPARED
            if isinstance(tuned.get(key), float | int) and isinstance(held.get(key), float | int)
        }
        self.stdout.write(json.dumps({"tuned": tuned, "held_out": held, "gap": gap}, ensure_ascii=False))


def _wait(answer: Answer, timeout: float) -> Answer:
    deadline = time.monotonic() + timeout
    while answer.status not in (Answer.Status.DONE, Answer.Status.FAILED):
        if time.monotonic() > deadline:
            raise CommandError(f"answer {answer.pk} to {answer.question!r} not finished after {timeout:g} s")
        time.sleep(0.25)
        answer.refresh_from_db()
    return answer


def holds_answer(item: dict, text: str) -> bool:
    """Whether ``text`` (NFKC) holds the item's answer: any listed answer, or every pattern."""
    if "answers" in item:
        return any(_nfkc(answer) in text for answer in item["answers"])
    return bool(item["patterns"]) and all(pattern.search(text) for pattern in item["patterns"])


class _Asking:
    """Asks questions of one workspace through the answer path and judges them."""

    def __init__(self, command, workspace, collections, route, timeout, removed_source):
        self.command, self.workspace, self.collections = command, workspace, collections
        self.route, self.timeout, self.removed_source = route, timeout, removed_source
        documents = Document.objects.filter(collection__workspace=workspace)
        if collections is not None:
            documents = documents.filter(collection__in=collections)
        # A document is named by its file, or a BEIR corpus's by its id there.
        self.files = {
            pk: (metadata.get("beir_ids") or [name])[0]
            for pk, name, metadata in documents.values_list("id", "source_name", "metadata")
        }
        self.texts: dict[int, str] = {}
        if removed_source:  # each document's text as its chunks hold it (overlaps do no harm)
            for document_id, text in Chunk.objects.filter(document__in=documents).values_list("document_id", "text"):
                self.texts[document_id] = self.texts.get(document_id, "") + "\n" + _nfkc(text)
        self.models: set[str] = set()

    def summary(self, items: list[dict]) -> dict:
        verdicts = [self.verdict(item) for item in items]
        return summarise(verdicts, ", ".join(sorted(self.models)))

    def ask(self, item: dict, documents_excluded: list[int]) -> Answer:
        answer = answer_create(
            workspace=self.workspace,
            question=item["question"],
            collections=self.collections,
            route_name=self.route,
            documents_excluded=documents_excluded,
        )
        answer = _wait(answer, self.timeout)
        if answer.route_id:  # one that abstained before any generation has no route
            self.models.add(answer.route.provider.model)
        elif answer.mode == Answer.Mode.EXTRACTIVE:
            self.models.add("extractive")
        return answer

    def verdict(self, item: dict) -> dict:
        answer = self.ask(item, [])
        verdict = judge(item, answer, self.files)
        flags = " ".join(
            f"{key}={verdict[key]}" for key in ("correct", "right_source", "abstained", "grounded", "finish_reason")
        )
        # The score the decline was decided on: what a line is chosen from.
        flags += f" relevance={answer.stats.get('relevance')}"
        if self.removed_source and item["kind"] != "unanswerable":
            own = [pk for pk, name in self.files.items() if name in item["sources"]]
            if any(holds_answer(item, text) for pk, text in self.texts.items() if pk not in own):
                verdict["removed_source_skipped"] = True
                flags += " removed_source=skipped"
            else:
                removed = self.ask(item, own)
                verdict["removed_source_abstained"] = removed.abstained
                flags += (
                    f" removed_source_declined={removed.abstained} removed_relevance={removed.stats.get('relevance')}"
                )
        self.command.stdout.write(f"{item['id']} {verdict['mode']} {verdict['total_ms']} ms {flags}")
        return verdict
