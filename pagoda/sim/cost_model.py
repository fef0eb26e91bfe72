"""How long an engine step takes, from what it computes: a linear model over the
step's composition, fitted to step times measured on a machine (`pagoda bench
profile`) and kept as JSON.

    seconds = overhead
            + per_prefill_token   * prompt tokens computed
            + per_decode_row      * rows that decode one token
            + per_decode_context  * context tokens those rows attend to
            + per_prefill_attention * sum over prompt chunks of n * (computed + n / 2)
              (a chunk of n tokens after `computed` attends to about that many pairs)

Coefficients are fitted non-negative (scipy's NNLS), so a model never predicts a
step cheaper for doing more.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pagoda.core.step_shape import StepShape

FEATURES = ("overhead", "per_prefill_token", "per_decode_row", "per_decode_context",
            "per_prefill_attention")  # fmt: skip


@dataclass(frozen=True)
class StepCostModel:
    overhead: float
    per_prefill_token: float
    per_decode_row: float
    per_decode_context: float
    per_prefill_attention: float
    # Where it came from: the machine, model and settings it was measured with, and
    # how well it fits those measurements.
    source: dict = field(default_factory=dict)

    def seconds(self, shape: StepShape) -> float:
        coefficients = (self.overhead, self.per_prefill_token, self.per_decode_row,
                        self.per_decode_context, self.per_prefill_attention)  # fmt: skip
        return sum(c * x for c, x in zip(coefficients, shape.features(), strict=True))

    @classmethod
    def fit(cls, shapes: list[StepShape], seconds: list[float], source: dict | None = None):
        """Non-negative least squares on relative error (each step weighs the same,
        short or long)."""
        import numpy as np
        from scipy.optimize import nnls

        x = np.array([s.features() for s in shapes], dtype=np.float64)
        y = np.array(seconds, dtype=np.float64)
        weights = 1.0 / y
        coefficients, _ = nnls(x * weights[:, None], y * weights)
        predicted = x @ coefficients
        error = np.abs(predicted - y) / y
        source = {**(source or {}), "steps": len(y), "mean_abs_error": float(error.mean()),
                  "p90_abs_error": float(np.quantile(error, 0.9)),
                  # The measurements: (prefill tokens, decode rows, decode context,
                  # prefill attention, seconds) per step.
                  "measured": [[*s.features()[1:], t] for s, t in zip(shapes, seconds, strict=True)]}  # fmt: skip
        return cls(*(float(c) for c in coefficients), source=source)

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def from_json(cls, path: str) -> StepCostModel:
        with open(path) as f:
            data = json.load(f)
        return cls(**{k: data[k] for k in FEATURES}, source=data.get("source", {}))


def default_cost_model() -> StepCostModel:
    """The model shipped with pagoda (`default_cost_model.json`: SmolLM2-135M Q4_1 on
    one thread of a 2-core AMD EPYC, by `pagoda bench profile --num-threads 1`), for a
    simulation given none."""
    from importlib.resources import files

    return StepCostModel.from_json(str(files("pagoda.sim").joinpath("default_cost_model.json")))
