"""Answering a question from retrieved chunks: the prompt (``prompting``), the generated or
extractive answer (``answers``, ``extractive``), its citations checked (``verification``),
declining when the sources are silent (``abstention``), and follow-ups read as standalone
questions (``rewriting``). Words and sentences come from ``search.analysis``."""
