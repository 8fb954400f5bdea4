"""Prompt-lookup proposals: continue the longest recent n-gram that occurred before.

The lookup covers the prompt (for RAG: the retrieved passages, which answers quote) and
the text generated so far (answers repeat their own phrases); a proposal costs no model
pass at all.
"""

from __future__ import annotations


class NGramProposer:
    def __init__(self, prompt_ids: list[int], *, n_max: int = 4, n_min: int = 2):
        self.n_max = n_max
        self.n_min = n_min
        self.tokens: list[int] = []
        # n-gram -> the position right after its latest occurrence that has a continuation
        self.index: dict[tuple[int, ...], int] = {}
        self.extend(prompt_ids)

    def extend(self, new_tokens: list[int]) -> None:
        """Add committed tokens; each n-gram now followed by a token is indexed."""
        for token in new_tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the n-grams ending just before this token gain a continuation
            for n in range(self.n_min, self.n_max + 1):
                if end - n >= 0:
                    self.index[tuple(self.tokens[end - n : end])] = end

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix of ``tokens`` seen before."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens) :])
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            start = self.index.get(tuple(tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + k]
        return []
