"""Prompt-lookup proposals: continue the longest recent n-gram that also occurs in the prompt.

For RAG the prompt holds the retrieved passages, which answers quote; a proposal costs
no model pass at all.
"""

from __future__ import annotations


class NGramProposer:
    def __init__(self, prompt_ids: list[int], *, n_max: int = 4, n_min: int = 2):
        self.prompt = list(prompt_ids)
        self.n_max = n_max
        self.n_min = n_min
        # n-gram -> start positions of its continuation in the prompt (latest last)
        self.index: dict[tuple[int, ...], list[int]] = {}
        for n in range(n_min, n_max + 1):
            for start in range(len(self.prompt) - n):
                self.index.setdefault(tuple(self.prompt[start : start + n]), []).append(start + n)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the longest suffix of ``tokens`` found in the prompt."""
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            positions = self.index.get(tuple(tokens[-n:]))
            if positions:
                start = positions[-1]  # the most recent occurrence
                return self.prompt[start : start + k]
        return []
