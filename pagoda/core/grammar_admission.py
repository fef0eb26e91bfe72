"""Structured outputs in the scheduler: a request starts only once its grammar has
compiled (on the compiler's thread; it waits in the queue meanwhile, passed over),
each appended token advances its matcher, and each step's sampled rows get one
bitmask of the tokens their grammars allow."""

from __future__ import annotations

from pagoda.core.sched_output import ScheduledRequest
from pagoda.core.scheduler_part import SchedulerPart
from pagoda.core.structured_output import GrammarCompiler
from pagoda.request import Request, RequestStatus


class GrammarAdmission(SchedulerPart):
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.compiling: list[Request] = []  # queued requests whose grammar is not ready
        self.failures: dict[str, str] = {}  # request id -> why its grammar failed (not yet taken)

    def add(self, request: Request) -> None:
        """Start compiling the request's grammar (`request.grammar` from now on)."""
        request.grammar = self.compiler.request_grammar(request.sampling_params.grammar)
        self.compiling.append(request)

    def begin_step(self, running: list[Request], head: Request | None) -> None:
        still = []
        for request in self.compiling:
            if not request.grammar.ready:
                still.append(request)
            elif (error := request.grammar.compiled.exception()) is not None:
                self.failures[request.request_id] = str(error)
        self.compiling = still

    def admits(self, request: Request) -> bool:
        grammar = request.grammar
        return grammar is None or (grammar.ready and grammar.compiled.exception() is None)

    def token_appended(self, request: Request, token_id: int) -> RequestStatus | None:
        """A grammar's request stops when the grammar is complete. (A token the grammar
        refuses cannot be sampled under its mask; it ends the request as failed.)"""
        if request.grammar is None:
            return None
        if request.before_grammar:  # the grammar starts after the reasoning's end
            after = request.sampling_params.grammar_after
            tail = request.all_token_ids[-len(after) :]  # the last tokens, not a copy of all
            request.before_grammar = request.num_output_tokens < len(after) or tuple(tail) != after
            return None
        if not request.grammar.accept(token_id):
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if request.grammar.complete else None

    def released(self, request: Request, finished: bool) -> None:
        if finished and request in self.compiling:
            self.compiling.remove(request)

    def take_failures(self) -> dict[str, str]:
        """The requests whose grammar failed to compile since the last call, with why
        (the engine ends them)."""
        failures, self.failures = self.failures, {}
        return failures

    def wait(self, timeout: float) -> None:
        """Block until a compiling grammar is ready (or `timeout`), instead of spinning."""
        if self.compiling:
            GrammarCompiler.wait_any([r.grammar for r in self.compiling], timeout)

    def bitmask(self, requests: dict[str, Request], scheduled: list[ScheduledRequest]):
        """One bitmask for every row sampled under a grammar this step (a request's
        last token and each of its drafts); sets each item's `grammar_row`."""
        rows, num_rows = [], 0
        for item in scheduled:
            request = requests[item.request_id]
            grammar = request.grammar
            if request.grammar_active and item.sampling_params is not None:
                item.grammar_row = num_rows
                rows.append((grammar, num_rows, item.draft_token_ids))
                num_rows += 1 + item.num_draft_tokens
        return self.compiler.bitmask(rows, num_rows) if rows else None
