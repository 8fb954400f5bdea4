import pytest

from search.query_syntax import query_parse, reads_as_question
from search.text_normalization import ENGLISH_STOP_WORDS, text_prepare


def test_plain_words_are_all_optional():
    parsed = query_parse("what similarity laws must be obeyed")
    assert parsed.optional == ["what", "similarity", "laws", "must", "be", "obeyed"]
    assert parsed.phrases == [] and parsed.excluded == []
    assert parsed.required_websearch("search_english") == ""
    assert parsed.rank_text == "what similarity laws must be obeyed"
    assert parsed.syntax == "search"


def test_quotes_exclusions_and_or_are_honoured_in_a_search_box():
    parsed = query_parse('wing OR flap "propeller slipstream" -jet -"heat transfer"')
    assert parsed.optional == ["wing", "flap"]
    assert parsed.phrases == ["propeller slipstream"]
    assert parsed.excluded == ["jet", "heat transfer"]
    assert parsed.required_websearch("search_english") == '"propeller slipstream" -"jet" -"heat transfer"'
    assert parsed.rank_text == "wing flap propeller slipstream"


def test_phrases_are_prepared_as_the_indexed_text_is():
    parsed = query_parse('"the boundary-layer of a wing" -"the" -"it"')
    # search_english removes its stop words from the text before indexing, so from phrases
    # too; an exclusion made only of stop words excludes nothing.
    assert parsed.required_websearch("search_english") == '"boundary layer wing"'
    assert parsed.required_websearch("english") == '"the boundary layer of a wing" -"the" -"it"'


def test_hyphenated_words_and_stray_syntax():
    parsed = query_parse('state-of-the-art  - "" "  spaced   out "')
    assert parsed.optional == ["state-of-the-art"]
    assert parsed.phrases == ["spaced out"]
    assert parsed.rank_text == "state-of-the-art spaced out"


def test_a_question_has_no_syntax():
    text = 'What is the "boundary layer" of a -40 degree wing, OR of a flap?'
    parsed = query_parse(text, syntax="question")
    assert parsed.syntax == "question"
    assert parsed.phrases == [] and parsed.excluded == []
    assert parsed.optional == text.split()  # quotes quote, -40 is a number, OR is a word
    assert parsed.rank_text == text
    assert parsed.required_websearch("search_english") == ""


@pytest.mark.parametrize(
    ("text", "question"),
    [
        ('"boundary layer" transition -laminar', False),
        ("wing OR flap", False),
        ('what is a "boundary layer"?', True),
        ("What is a boundary layer ?  ", True),
        ('Is the "shock wave" stable?"', True),
        ("papers on the heat transfer of blunt bodies at high speed", True),  # 11 words
        ("heat transfer blunt bodies high speed flow", False),  # 7 words
    ],
)
def test_auto_reads_a_sentence_as_a_question(text, question):
    assert reads_as_question(text) is question
    assert query_parse(text, syntax="auto").syntax == ("question" if question else "search")


def test_unknown_syntax_is_refused():
    with pytest.raises(ValueError, match="unknown query syntax 'regex'"):
        query_parse("wing", syntax="regex")


def test_stop_words_are_removed_as_whole_words_only():
    assert len(ENGLISH_STOP_WORDS) == 33
    text = "The Atlas-7's theory: IT is in-flight, not into Anatomy; its being theirs"
    prepared = text_prepare(text, "search_english")
    assert prepared.split() == ["Atlas", "7", "s", "theory", "flight", "Anatomy", "its", "being", "theirs"]
    assert text_prepare("The theory", "english").split() == ["The", "theory"]  # other configurations: as they are
