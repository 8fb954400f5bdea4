"""What a generation request may ask, checked alike by every backend (our engine,
``inference.remote``'s upstreams, the router): no Django, no torch, so that the serving path
(web, remote workers) checks a request without loading the reference engine."""

from __future__ import annotations


class GenerationError(ValueError):
    """A request that cannot run; ``field`` names the parameter at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_sampling(*, temperature: float, top_p: float, max_tokens: int, k: int | None = None) -> None:
    """The request parameters every backend takes alike (the local engine, ``inference.remote``);
    ``k``, the tokens proposed per step, only where the request sets it (our engine)."""
    if k is not None and not 1 <= k <= 16:
        raise GenerationError("speculative.k", f"must be between 1 and 16, got {k}")
    if temperature < 0:
        raise GenerationError("temperature", f"must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise GenerationError("top_p", f"must be in (0, 1], got {top_p}")
    if max_tokens < 1:
        raise GenerationError("max_tokens", f"must be at least 1, got {max_tokens}")
