"""Per-request pooling parameters (vLLM's `PoolingParams`): what a request returns from
the model's hidden states instead of generated tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.checks import INT32_MAX, check_bool, check_int, fail

# "embed": a vector; "classify": class probabilities (a softmax over the classifier's
# logits); "score": a text pair's relevance (a cross-encoder's logit through a sigmoid).
# Generation is SamplingParams'.
POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """`task`: what to return (POOLING_TASKS). `dimensions`: an embedding's first N values
    (Matryoshka models), normalized again; `normalize`: whether embeddings come out with
    unit length (None: as the model's own, its sentence-transformers `Normalize`);
    `truncate_prompt_tokens`: cut longer inputs to N tokens as the tokenizer truncates
    (its special tokens kept), where a longer input is otherwise refused. Checked when
    built and again by the front door, which raises InvalidRequestError naming the field."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    # Filled in by the front door: where a scored pair's second text starts (the
    # position from which a BERT-style model reads token type 1).
    pair_start: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.check_fields()

    def check_fields(self) -> None:
        if self.task not in POOLING_TASKS:
            fail("task", f"must be one of {', '.join(POOLING_TASKS)}", self.task)
        if self.dimensions is not None:
            check_int(self.dimensions, "dimensions", 1, INT32_MAX)
            if self.task != "embed":
                fail("dimensions", "applies to embeddings only")
        if self.normalize is not None:
            check_bool(self.normalize, "normalize")
        if self.truncate_prompt_tokens is not None:
            check_int(self.truncate_prompt_tokens, "truncate_prompt_tokens", 1, INT32_MAX)
