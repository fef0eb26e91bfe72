"""Pooling requests compute their prompt whole, in one step: an encoder's attention sees
the whole prompt at once, and pooling reads every token's hidden state."""

from __future__ import annotations

from pagoda.core.scheduler_part import SchedulerPart
from pagoda.request import Request


class WholePrompts(SchedulerPart):
    def limit_tokens(self, request: Request, start: int, num_new: int) -> int:
        """All that is left of a pooling request's prompt, or nothing this step."""
        if request.pooling_params is not None and start + num_new < request.num_tokens:
            return 0
        return num_new
