"""Which waiting requests may start beside the running adapters (multi-LoRA).

At most `max_loras` adapters run at once (as they fit the model's slots). A waiting
request whose adapter does not fit is passed over and keeps its place, so it does not
hold up requests for resident adapters; once the queue's head has waited
`MAX_STEPS_PASSED_OVER` steps in a row, only base-model requests pass it, so the
running adapters drain and its own gets a slot.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.core.scheduler_part import SchedulerPart
from pagoda.core.stats import LoRAStats
from pagoda.request import Request, RequestStatus

MAX_STEPS_PASSED_OVER = 32


class LoRAAdmission(SchedulerPart):
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.running_loras: set[int] = set()  # adapters of the running requests, this step
        self.num_steps_head_passed_over = 0  # steps in a row the head waited for its adapter
        self.starving = False  # the head has waited too long: only base-model requests pass

    def fits(self, request: Request) -> bool:
        lora_id = request.lora_int_id
        return (
            not lora_id or lora_id in self.running_loras or len(self.running_loras) < self.max_loras
        )

    def begin_step(self, running: list[Request], head: Request | None) -> None:
        self.running_loras = {r.lora_int_id for r in running if r.lora_int_id}
        blocked = head is not None and not self.fits(head)
        self.num_steps_head_passed_over = self.num_steps_head_passed_over + 1 if blocked else 0
        self.starving = self.num_steps_head_passed_over > MAX_STEPS_PASSED_OVER

    def admits(self, request: Request) -> bool:
        if not self.fits(request):
            return False
        return not self.starving or not request.lora_int_id

    def scheduled(self, request: Request, start: int, num_new: int) -> None:
        if request.lora_int_id:
            self.running_loras.add(request.lora_int_id)

    def stats(self, requests: Iterable[Request]) -> LoRAStats:
        running, waiting = set(), set()
        for r in requests:
            if r.lora_request is not None:
                is_running = r.status == RequestStatus.RUNNING
                (running if is_running else waiting).add(r.lora_request.lora_name)
        return LoRAStats(self.max_loras, tuple(sorted(running)), tuple(sorted(waiting)))
