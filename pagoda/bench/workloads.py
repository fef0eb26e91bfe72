"""Seeded synthetic workloads (BENCHMARKS.md) and user datasets.

Token ids are drawn from the model's vocabulary, skipping special tokens;
output lengths are exact (the engine ignores EOS).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

WORKLOADS = (
    "mixed", "uniform", "shared-prefix", "long", "online", "grounded", "chat", "multiturn",
)  # fmt: skip

# `multiturn`: conversations whose every turn resends the history (a system prompt and
# document, then the earlier turns) and adds a question; the turns go round-robin over
# the conversations, so a conversation's next turn comes after every other's.
MULTITURN_CONVERSATIONS = 16
MULTITURN_TURNS = 4
MULTITURN_FIRST, MULTITURN_ANSWER, MULTITURN_QUESTION = 1024, 128, 64  # tokens

# `grounded`: asks whose answer repeats text from the prompt, as summarizing, editing
# and extraction do (where n-gram speculation pays). Passages from the shipped prose.
GROUNDED_ASKS = (
    "Copy the following passage exactly, word for word.",
    "Fix any spelling mistakes in the following passage and return the whole passage.",
    "Quote the following passage in full, then say in one sentence what it is about.",
    "Rewrite the following passage with one sentence per line, changing no words.",
)

# `chat`: open questions whose answers repeat nothing of the prompt (where only a
# draft model can guess ahead); 128 tokens each.
CHAT_ASKS = (
    "Explain to a beginner how {}.",
    "Write a short story in which {}.",
    "Give three reasons why {}, with an example for each.",
    "Describe step by step how {}.",
)
CHAT_TOPICS = (
    "a bicycle stays upright",
    "bread rises in the oven",
    "a city plans its water supply",
    "bees find their way home",
    "a compiler turns code into a program",
    "the seasons change",
    "a small shop keeps its accounts",
    "a river shapes its valley",
)


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0  # seconds after the start
    prompt: str | None = None  # for HTTP clients; decoded from the ids when absent


def _vocab(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def make_workload(
    name: str,
    tokenizer,
    seed: int = 42,
    num_prompts: int | None = None,
    request_rate: float = float("inf"),
    max_model_len: int | None = None,
    num_prefixes: int = 1,
) -> list[BenchRequest]:
    """The named workload. `num_prompts` overrides the default count; `online`
    arrivals are Poisson at `request_rate` requests/s; `shared-prefix` draws each
    prompt's prefix from `num_prefixes` (families, for routing by prefix)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}.")
    rng = random.Random(seed)
    vocab = _vocab(tokenizer)

    def tokens(n: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(n)]

    if name in ("mixed", "online"):
        n = num_prompts or (64 if name == "mixed" else 256)
        reqs = [BenchRequest(tokens(rng.randint(32, 512)), rng.randint(32, 256)) for _ in range(n)]
    elif name == "uniform":
        reqs = [BenchRequest(tokens(128), 128) for _ in range(num_prompts or 256)]
    elif name == "shared-prefix":
        prefixes = [tokens(448) for _ in range(num_prefixes)]

        def prefix() -> list[int]:  # one family: the draws of earlier sessions, unchanged
            return rng.choice(prefixes) if num_prefixes > 1 else prefixes[0]

        reqs = [
            BenchRequest(prefix() + tokens(rng.randint(16, 64)), 64)
            for _ in range(num_prompts or 64)
        ]
    elif name == "grounded":
        reqs = _grounded(tokenizer, rng, num_prompts or 16)
    elif name == "multiturn":
        reqs = _multiturn(tokens, num_prompts or MULTITURN_CONVERSATIONS * MULTITURN_TURNS)
    elif name == "chat":
        asks = [a.format(t) for t in CHAT_TOPICS for a in CHAT_ASKS]
        reqs = [_chat_request(tokenizer, rng.choice(asks), 128) for _ in range(num_prompts or 16)]
    else:  # long
        prompt_len = 4096 if max_model_len is None else min(4096, max_model_len - 64)
        reqs = [BenchRequest(tokens(prompt_len), 64) for _ in range(num_prompts or 8)]
    if name == "online" or request_rate != float("inf"):
        assign_poisson_arrivals(reqs, request_rate, rng)
    return reqs


def _multiturn(tokens, n: int) -> list[BenchRequest]:
    """n turns, round-robin over the conversations (as many as n allows, up to 16). A
    turn's history holds a stand-in for each earlier answer (the tokens the model will
    have sampled are not known ahead), so what a later turn finds cached is the earlier
    prompts: a reply costs MULTITURN_ANSWER tokens to recompute."""
    num_conversations = min(n, MULTITURN_CONVERSATIONS)
    histories = [tokens(MULTITURN_FIRST) for _ in range(num_conversations)]
    reqs = []
    for i in range(n):
        history = histories[i % num_conversations]
        reqs.append(BenchRequest(list(history), MULTITURN_ANSWER))
        history += tokens(MULTITURN_ANSWER) + tokens(MULTITURN_QUESTION)
    return reqs


def _grounded(tokenizer, rng: random.Random, n: int) -> list[BenchRequest]:
    """Chat prompts (plain text without a chat template) holding a passage of 60 to 160
    tokens that the answer repeats; the output is the passage's length and a bit."""
    from importlib.resources import files

    text = files("pagoda.eval").joinpath("heldout.txt").read_text(encoding="utf-8")
    passages = [p for p in text.split("\n\n") if 60 <= len(tokenizer.encode(p)) <= 160]
    reqs = []
    for _ in range(n):
        passage = rng.choice(passages)
        content = f"{rng.choice(GROUNDED_ASKS)}\n\n{passage}"
        reqs.append(_chat_request(tokenizer, content, len(tokenizer.encode(passage)) + 16))
    return reqs


def _chat_request(tokenizer, content: str, output_len: int) -> BenchRequest:
    """One user turn in the model's chat template (plain text without one)."""
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    else:
        prompt = content + "\n\n"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return BenchRequest(ids, output_len, prompt=prompt)


def assign_poisson_arrivals(reqs: list[BenchRequest], rate: float, rng: random.Random) -> None:
    t = 0.0
    for r in reqs:
        r.arrival_time = t
        if rate != float("inf"):
            t += rng.expovariate(rate)


def load_dataset(path: str, tokenizer, default_output_len: int = 128) -> list[BenchRequest]:
    """A JSONL file, one request a line: {"prompt": str, "output_len"?: int}
    (or "prompt_token_ids" instead of "prompt")."""
    reqs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            if "prompt_token_ids" in row:
                ids, text = list(row["prompt_token_ids"]), row.get("prompt")
            elif isinstance(row.get("prompt"), str):
                text = row["prompt"]
                ids = tokenizer.encode(text)
            else:
                raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'prompt_token_ids'.")
            reqs.append(
                BenchRequest(ids, int(row.get("output_len", default_output_len)), prompt=text)
            )
    if not reqs:
        raise ValueError(f"{path}: no requests.")
    return reqs


def json_schemas(n: int = 50) -> list[dict]:
    """n JSON schemas for structured-output runs: nested objects, arrays, enums, bounded
    numbers, optional fields and anyOf, each bounded so that a completion ends."""

    def text(n: int) -> dict:
        return {"type": "string", "maxLength": n}

    year = {"type": "integer", "minimum": 1800, "maximum": 2030}
    parts = [
        ("name", text(20)),
        ("count", {"type": "integer", "minimum": 0, "maximum": 1000}),
        ("score", {"type": "number", "minimum": 0, "maximum": 10}),
        ("active", {"type": "boolean"}),
        ("kind", {"enum": ["small", "medium", "large"]}),
        ("tags", {"type": "array", "items": text(10), "minItems": 1, "maxItems": 3}),
        (
            "origin",
            {
                "type": "object",
                "properties": {"country": text(15), "year": year},
                "required": ["country", "year"],
                "additionalProperties": False,
            },
        ),
        ("id", {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 99999}, text(8)]}),
        (
            "ratings",
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": 5},
                "maxItems": 4,
            },
        ),
        ("note", {"anyOf": [{"type": "null"}, text(30)]}),
    ]
    schemas = []
    for i in range(n):
        # A title of its own length makes each schema (and its grammar) distinct.
        chosen = [("title", text(8 + i))]
        chosen += [parts[(i + 3 * k) % len(parts)] for k in range(1 + i % 4)]
        required = [name for j, (name, _) in enumerate(chosen) if j % 3 != 2 or i % 2]
        schemas.append(
            {
                "type": "object",
                "properties": dict(chosen),
                "required": required,
                "additionalProperties": False,
            }
        )
    return schemas
