"""SQL aggregates Django lacks, used by the canary analysis and the dashboards."""

from __future__ import annotations

from django.db.models import Aggregate, FloatField


class PercentileCont(Aggregate):
    """PostgreSQL's ``percentile_cont(f) WITHIN GROUP (ORDER BY expr)``: NULLs are ignored,
    and the value interpolates linearly between the two nearest rows."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression, fraction: float, **extra):
        fraction = float(fraction)
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        super().__init__(expression, fraction=repr(fraction), **extra)
