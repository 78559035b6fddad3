"""A search's ``budget.time_limit_s``: Ray Tune's timeout stopper (the budget left is kept across a
``--resume``), which also records in :data:`~prvrlab.platform.search.outcome.TIME_LIMIT` that it stopped
the search, so that the trials it cut are not taken for trials ASHA stopped early."""

from __future__ import annotations

from ray.tune.stopper import TimeoutStopper

from prvrlab.platform.search.outcome import TIME_LIMIT


def time_limit_reason(seconds: float) -> str:
    """The stop reason of a trial (or search) the time limit cut."""
    return f"budget.time_limit_s ({seconds:g} s) ran out"


class TimeLimit(TimeoutStopper):
    """Stops every trial once ``seconds`` of the search have passed, and sets ``TIME_LIMIT``."""

    def stop_all(self) -> bool:
        reached = super().stop_all()
        if reached:
            TIME_LIMIT.set()
        return reached
