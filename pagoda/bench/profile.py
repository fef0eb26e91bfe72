"""`pagoda bench profile`: measure engine steps on this machine and fit the step cost
model the simulator uses (pagoda.sim.cost_model), written as JSON.

Steps of three kinds run through the real engine, each timed around `step()` with
the scheduler's output read for its composition:
- prompts alone, of several lengths (chunked as the engine's budget chunks them);
- decode batches of several sizes at several context lengths (their prompts share a
  prefix, so the prefix cache computes it once);
- a mix: prompts arriving while a batch decodes.
The first steps (warm-up) are left out.
"""

from __future__ import annotations

import platform
import random
import time

from pagoda.bench.report import cpu_name
from pagoda.core.step_shape import StepShape
from pagoda.sim.cost_model import StepCostModel

PROMPT_LENGTHS = (16, 64, 128, 256, 512, 1024, 2048)
DECODE_ROWS = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (64, 512, 1024)
WARMUP_STEPS = 3


class _Recorder:
    """The engine's steps, each with its scheduler output and its time."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.shapes: list[StepShape] = []
        self.seconds: list[float] = []
        self._last = None
        schedule = engine.scheduler.schedule

        def spy(*args, **kwargs):
            self._last = schedule(*args, **kwargs)
            return self._last

        engine.scheduler.schedule = spy

    def step(self) -> None:
        self._last = None
        start = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - start
        if self._last is not None and self._last.scheduled:
            self.shapes.append(StepShape.of(self._last))
            self.seconds.append(elapsed)

    def run(self, bar=None) -> None:
        while self.engine.has_unfinished_requests():
            self.step()
            if bar is not None:
                bar.update(1)


def profile(engine_kwargs: dict, seed: int = 0, progress: bool = True) -> StepCostModel:
    from tqdm import tqdm

    from pagoda import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    engine = llm.llm_engine
    vocab = len(engine.tokenizer)
    rng = random.Random(seed)
    recorder = _Recorder(engine)
    ids = iter(range(1 << 30))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    def add(prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(f"p{next(ids)}", {"prompt_token_ids": prompt}, params)

    bar = tqdm(desc="profile steps", unit="step", disable=not progress)
    for length in PROMPT_LENGTHS * 2:  # prompts alone
        add(tokens(length), 1)
        recorder.run(bar)
    for count in (2, 4, 8, 16):  # several prompts at once, chunked together
        for _ in range(count):
            add(tokens(rng.randrange(32, 512)), 1)
        recorder.run(bar)
    for context in DECODE_CONTEXTS:  # decode batches; the shared prefix computed once
        prefix = tokens(context)
        for rows in DECODE_ROWS:
            for _ in range(rows):
                add(prefix + tokens(1), 16)
            recorder.run(bar)
    for _ in range(4):  # a mix: prompts joining a decoding batch
        for _ in range(8):
            add(tokens(rng.randrange(16, 512)), rng.randrange(16, 64))
        for _ in range(8):
            recorder.step()
            add(tokens(rng.randrange(16, 256)), rng.randrange(8, 32))
        recorder.run(bar)
    bar.close()
    shapes, seconds = recorder.shapes[WARMUP_STEPS:], recorder.seconds[WARMUP_STEPS:]
    source = {
        "model": engine.model_config.path,
        "engine": {k: v for k, v in engine_kwargs.items() if v is not None},
        "machine": platform.machine(),
        "cpu": cpu_name(),
    }
    return StepCostModel.fit(shapes, seconds, source)
