from inference.engine.proposers import NGramProposer


def test_continues_the_longest_match_from_the_prompt():
    proposer = NGramProposer([1, 2, 3, 4, 5, 9, 2, 3, 7, 8], n_max=3, n_min=2)
    # "2 3" last occurred before "7 8"; "4 2 3" never did, so the 2-gram decides.
    assert proposer.propose([6, 4, 2, 3], 3) == [7, 8]
    # A longer match wins over a more recent shorter one: "1 2 3" -> "4 5 9".
    assert proposer.propose([0, 1, 2, 3], 3) == [4, 5, 9]
    assert proposer.propose([42, 43], 3) == []


def test_generated_text_is_looked_up_too():
    proposer = NGramProposer([1, 2, 3], n_max=2, n_min=2)
    tokens = [1, 2, 3, 10, 11, 12, 10, 11]
    assert proposer.propose(tokens, 2) == [12, 10]
