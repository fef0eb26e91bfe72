"""Structured outputs: a grammar per request masks its logits every step (llguidance).

Three places touch a grammar:

- the front door (`build_grammar`, on the Processor's thread) turns a request's
  `StructuredOutputsParams` into llguidance's grammar text and checks it without a
  tokenizer (milliseconds), so a bad schema is a 400 naming the field;
- the `GrammarCompiler` (owned by the scheduler) compiles each distinct grammar once,
  on its own thread, into an LRU cache; each request then takes a copy of the
  compiled matcher (its own parse state). A request waits for its grammar outside
  the waiting queue, so the step loop never blocks on a compile;
- each step the scheduler fills one bitmask (numpy: `pagoda/core` stays free of
  torch) for every row that samples under a grammar (drafts included) in one
  parallel llguidance call, the sampler applies it in one op (`apply_bitmask`), and
  the scheduler advances each matcher by the tokens it keeps.

Preemption keeps a request's tokens (recompute computes them again; it does not
sample them), so a matcher never rolls back: rejected drafts never reach it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import numpy as np

from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar", "json_object")
_MAX_CHOICES = 4096
# JSON as json.dumps writes it: no free whitespace, so a model cannot pad its answer
# with newlines until max_tokens (llguidance's default allows any). A schema's
# "x-guidance" object overrides this (e.g. {"whitespace_flexible": true}).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _fail(kind: str, why: str) -> None:
    raise InvalidRequestError(f"structured_outputs.{kind} {why}", "structured_outputs")


def build_grammar(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for a request's constraint, checked (no tokenizer needed).
    Raises InvalidRequestError naming structured_outputs and what is wrong."""
    if not isinstance(so, StructuredOutputsParams):
        raise InvalidRequestError(
            "structured_outputs must be a StructuredOutputsParams", "structured_outputs"
        )
    given = [k for k in KINDS if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(
            f"structured_outputs must set exactly one of {', '.join(KINDS)} "
            f"({', '.join(given) or 'none'} set)",
            "structured_outputs",
        )
    kind = given[0]
    value = getattr(so, kind)
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as e:
                _fail(kind, f"is not valid JSON: {e}")
        if not isinstance(schema, dict | bool):
            _fail(kind, "must be a JSON schema (an object)")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_LAYOUT)
    elif kind == "json_object":
        if value is not True:
            _fail(kind, "must be true or unset")
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_LAYOUT)
    elif kind == "choice":
        if not isinstance(value, list) or not 0 < len(value) <= _MAX_CHOICES:
            _fail(kind, f"must be a list of 1 to {_MAX_CHOICES} strings")
        if not all(isinstance(c, str) and c for c in value):
            _fail(kind, "must hold only non-empty strings")
        # A Lark string literal takes JSON's escapes.
        grammar = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in value)
        )
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            _fail(kind, "must be a non-empty string")
        try:
            # "grammar": Lark (llguidance's dialect) or GBNF, told apart by llguidance.
            grammar = llguidance.grammar_from("regex" if kind == "regex" else "grammar", value)
        except ValueError as e:
            _fail(kind, f"is not a grammar pagoda can use: {e}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        _fail(kind, f"is not one pagoda can use: {error.strip()}")
    return grammar


class GrammarCompileError(Exception):
    """A grammar that passed the front door's check failed to compile with the tokenizer."""


class RequestGrammar:
    """One request's grammar: the compiled grammar (a future until it is) and, once
    the request first samples, its own matcher."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self._matcher: llguidance.LLMatcher | None = None

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            self._matcher = self.compiled.result().deep_copy()
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self.matcher.consume_token(token_id)

    @property
    def complete(self) -> bool:
        """The grammar allows no further token: the request is done."""
        return self.matcher.is_stopped()

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (drafts) the grammar allows in a row from here."""
        return self.matcher.validate_tokens(token_ids)


class GrammarCompiler:
    """Compiles grammars for one tokenizer, each distinct grammar once (LRU cache),
    on one background thread; fills a batch's token bitmask in parallel."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        num_threads: int,
        cache_size: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids) or None
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built by the pool thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()  # engine thread only
        self._cache_size = cache_size
        self._executor = llguidance.LLExecutor(num_threads)
        self.compile_seconds: list[float] = []  # per distinct grammar compiled
        self.tokenizer_seconds = 0.0  # building llguidance's view of the tokenizer (once)

    def request_grammar(self, grammar: str) -> RequestGrammar:
        future = self._cache.get(grammar)
        if future is None:
            future = self._pool.submit(self._compile, grammar)
            self._cache[grammar] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(grammar)
        return RequestGrammar(future)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        if self._ll_tokenizer is None:
            start = time.perf_counter()
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
            )
            self.tokenizer_seconds = time.perf_counter() - start
            logger.info("grammar tokenizer built in %.2f s", self.tokenizer_seconds)
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarCompileError(matcher.get_error())
        self.compile_seconds.append(time.perf_counter() - start)
        return matcher

    @staticmethod
    def wait_any(grammars: list[RequestGrammar], timeout: float) -> None:
        """Block until one of the grammars compiles, or `timeout` seconds."""
        concurrent.futures.wait(
            [g.compiled for g in grammars], timeout, concurrent.futures.FIRST_COMPLETED
        )

    def bitmask(
        self, rows: list[tuple[RequestGrammar, int, list[int]]], num_rows: int
    ) -> np.ndarray:
        """[num_rows, ceil(V / 32)] int32, bit t of a row set where token t is allowed.
        `rows`: (grammar, its first row, drafts); a request's row j + 1 is the mask after
        its drafts 0..j (all-allowed past a draft the grammar refuses)."""
        bitmask = np.full((num_rows, self.words), -1, dtype=np.int32)
        args = (bitmask.ctypes.data, self.words * 4, num_rows)
        plain = [(g.matcher, row) for g, row, drafts in rows if not drafts]
        drafted = [(g.matcher, row, drafts) for g, row, drafts in rows if drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, *args)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, *args)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
