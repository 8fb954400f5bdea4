"""What an answer says about itself, in the language of its question.

An answer's own sentences (that it declines, that it quotes its sources and why) are part of
its text, stored and streamed, so they follow the question's language, not the reader's
interface language (which translates labels around the answer: frontdoors/ui). The reasons
(``why``) are stored in English in ``stats`` for operators, and said here in the answer's.
"""

from __future__ import annotations

from search.analysis import ENGLISH, JAPANESE

_SAID = {
    "not_answered": {
        ENGLISH: "The sources found do not answer this question.",
        JAPANESE: "見つかった資料には、この質問への答えがありません。",
    },
    "closest_lead": {ENGLISH: "Closest passages:", JAPANESE: "最も近い箇所："},
    "nothing_found": {
        ENGLISH: "The searched collections hold no passage that matches the question.",
        JAPANESE: "検索したコレクションに、質問に合う箇所はありません。",
    },
    "extracted": {ENGLISH: "Extracted from the sources ({why}):", JAPANESE: "資料から抜粋しました（{why}）："},
    "withheld": {
        ENGLISH: "This answer cites documents you may not read, so it is not shown.",
        JAPANESE: "この回答は閲覧権限のない資料を引用しているため、表示できません。",
    },
    "quoted": {
        ENGLISH: "Quoted from the sources (nothing in the model's answer was supported by them):",
        JAPANESE: "資料から引用しました（モデルの回答には資料で裏付けられる内容がありませんでした）：",
    },
}

# Why no model wrote an answer (``stats["why"]``, in English), as said in Japanese.
NO_MODEL = "no generation model is configured"
MODEL_STARTING = "the generation model is still starting"
LANGUAGE_NOT_SPOKEN = "the generation model does not answer in {language}"
_WHY_JAPANESE = {
    NO_MODEL: "生成モデルが設定されていません",
    MODEL_STARTING: "生成モデルはまだ起動中です",
    LANGUAGE_NOT_SPOKEN.format(language="Japanese"): "生成モデルが日本語で回答できないため",
}
LANGUAGE_NAMES = {ENGLISH: "English", JAPANESE: "Japanese"}


def said(key: str, language: str, **fields: str) -> str:
    """The sentence ``key`` in ``language`` (English for a language without its own)."""
    texts = _SAID[key]
    return texts.get(language, texts[ENGLISH]).format(**fields)


def why_said(why: str, language: str) -> str:
    """A reason stored in English, as an answer in ``language`` says it."""
    return _WHY_JAPANESE.get(why, why) if language == JAPANESE else why
