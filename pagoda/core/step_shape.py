"""What an engine step computes, as step-time estimates read it: the simulator's cost
model (pagoda/sim/cost_model.py) and the deadlines' online estimate
(core/deadlines.py) alike."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.core.sched_output import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as the cost model reads it."""

    prefill_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0
    prefill_attention: float = 0.0

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        prefill = rows = context = 0
        attention = 0.0
        for item in out.scheduled:
            n, computed = len(item.token_ids), item.num_computed_tokens
            if n == 1 or item.num_draft_tokens:  # a decode row (drafts ride along)
                rows += n
                context += n * (computed + n)
            else:
                prefill += n
                attention += n * (computed + n / 2)
        return cls(prefill, rows, context, attention)

    def features(self) -> tuple[float, ...]:
        return (1.0, self.prefill_tokens, self.decode_rows, self.decode_context,
                self.prefill_attention)  # fmt: skip
