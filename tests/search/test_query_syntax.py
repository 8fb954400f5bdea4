from search.query_syntax import query_parse


def test_plain_words_are_all_optional():
    parsed = query_parse("what similarity laws must be obeyed")
    assert parsed.optional == ["what", "similarity", "laws", "must", "be", "obeyed"]
    assert parsed.phrases == [] and parsed.excluded == []
    assert parsed.optional_websearch == "what or similarity or laws or must or be or obeyed"
    assert parsed.required_websearch == ""
    assert parsed.rank_text == "what similarity laws must be obeyed"


def test_quotes_exclusions_and_or_are_honoured():
    parsed = query_parse('wing OR flap "propeller slipstream" -jet -"heat transfer"')
    assert parsed.optional == ["wing", "flap"]
    assert parsed.phrases == ["propeller slipstream"]
    assert parsed.excluded == ["jet", "heat transfer"]
    assert parsed.required_websearch == '"propeller slipstream" -"jet" -"heat transfer"'
    assert parsed.rank_text == "wing flap propeller slipstream"


def test_hyphenated_words_and_stray_syntax():
    parsed = query_parse('state-of-the-art  - "" "  spaced   out "')
    assert parsed.optional == ["state-of-the-art"]
    assert parsed.phrases == ["spaced out"]
    assert parsed.optional_websearch == "state or of or the or art"
