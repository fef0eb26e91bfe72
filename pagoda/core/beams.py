"""Beam search in the scheduler, step for step transformers' `generate(num_beams=...)`.

A beam search is a group of beams, each one a `Request`. A beam computes its next
position like any request, but reports its candidates (the runner's top logprobs)
instead of appending a token. When every live beam of a group has reported, the
group steps, in transformers' float32 arithmetic (`_beam_search` in
`transformers/generation/utils.py`):

    candidates   each beam's score + each of its top tokens' logprob; keep the best
                 `num_keep` = max(2, 1 + stop tokens) x width over all beams
    finished     those among the best `width` that end (a stop token, or the length
                 limit) become hypotheses, scored sum / (length ** length_penalty);
                 the best `width` hypotheses are kept
    next beams   the best `width` candidates that did not end
    done         transformers' early-stop heuristic, all `width` hypotheses found
                 with early_stopping=True, or every candidate ended

A beam continued once keeps its request (the token appended). Continued again, it
forks: the child shares every block of its parent by reference count, and the first
of them to write into the shared partial block copies it (copy-on-write), so a beam
costs only its own blocks. A beam not continued ends. When the group is done, its
best hypotheses are the request's completions, under the completions' ids.

A beam that has reported holds blocks but computes nothing until its group steps.
When it is preempted, or when nothing else can run (the scheduler's stall), it parks:
its blocks go back and it waits in neither queue; the group's step then queues its
continuations, which compute their tokens again (from the prefix cache, where it
still holds them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from pagoda.core.sched_output import EngineCoreOutput
from pagoda.request import Request, RequestStatus

F32 = np.float32
NEG = F32(-1e9)  # transformers' "never" score

# (token id, logprob, rank in its beam's distribution)
TokenLogprob = tuple[int, float, int]


@dataclass
class Beam:
    request: Request
    score: np.float32  # summed logprob of its output tokens, in float32 as transformers sums
    logprobs: list[TokenLogprob]


@dataclass
class Hypothesis:
    """A finished beam."""

    score: np.float32  # length-penalized
    token_ids: list[int]  # its output tokens
    cumulative_logprob: np.float32
    logprobs: list[TokenLogprob]
    stop_token: int | None  # the stop token it ended on (None: the length limit)


@dataclass
class BeamStep:
    """What a group's step asks of the scheduler (the new tokens are appended already)."""

    forks: list[tuple[Request, Request]] = field(default_factory=list)  # parent, child
    ended: list[Request] = field(default_factory=list)
    outputs: list[EngineCoreOutput] = field(default_factory=list)  # the completions, when done
    num_tokens: int = 0  # tokens appended
    # Set by BeamSearch: the forks whose parent holds its blocks (the child shares them),
    # and the beams to queue (other forks, parked beams continued).
    shared: list[tuple[Request, Request]] = field(default_factory=list)
    queued: list[Request] = field(default_factory=list)


class BeamGroup:
    def __init__(self, root: Request, completion_ids: list[str], max_model_len: int) -> None:
        params = root.sampling_params
        self.completion_ids = completion_ids
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.stop_token_ids = set(params.stop_token_ids)
        self.stops = self.stop_token_ids | (
            set() if params.ignore_eos else set(params.eos_token_ids)
        )
        self.num_keep = max(2, 1 + len(self.stops)) * self.width
        self.max_new = max_model_len - root.num_prompt_tokens
        if params.max_tokens is not None:
            self.max_new = min(self.max_new, params.max_tokens)
        self.beams: list[Beam] = [Beam(root, F32(0.0), [])]  # best first
        self.reports: dict[str, dict[int, tuple[float, int]]] = {}  # beam id -> candidates
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.improvable = True  # transformers' early-stop heuristic, not yet satisfied
        self.num_generated = 0
        self.num_beams_made = 1

    @property
    def ready(self) -> bool:
        return len(self.reports) == len(self.beams)

    def step(self) -> BeamStep:
        """One step of the search from every beam's report (see the module's docstring)."""
        candidates = []  # (score, beam index, token, logprob, rank)
        for b, beam in enumerate(self.beams):
            for token, (logprob, rank) in self.reports.pop(beam.request.request_id).items():
                candidates.append((beam.score + F32(logprob), b, token, logprob, rank))
        # Ties as torch.topk breaks them over the flat (beam, token) index.
        top = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[: self.num_keep]
        at_limit = self.num_generated + 1 >= self.max_new
        ends = [at_limit or c[2] in self.stops for c in top]
        penalty = F32(float(self.num_generated + 1) ** self.length_penalty)
        new = [
            self._hypothesis(c, penalty)
            for c, end in zip(top[: self.width], ends[: self.width], strict=True)
            if end
        ]
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.width]
        running = [c[0] + NEG if end else c[0] for c, end in zip(top, ends, strict=True)]
        order = sorted(range(len(top)), key=lambda i: (-running[i], i))[: self.width]
        self.num_generated += 1
        never = self.early_stopping == "never" and self.length_penalty > 0
        best_length = self.max_new if never else self.num_generated
        best_possible = running[order[0]] / F32(float(best_length) ** self.length_penalty)
        full = len(self.finished) == self.width
        worst = min(h.score for h in self.finished) if full else NEG
        self.improvable = self.improvable and bool(best_possible > worst)
        if not self.improvable or (full and self.early_stopping is True) or all(ends):
            return self._done()
        return self._continue([top[i] for i in order])

    def _hypothesis(self, candidate, penalty: np.float32) -> Hypothesis:
        score, b, token, logprob, rank = candidate
        beam = self.beams[b]
        return Hypothesis(
            score / penalty,
            beam.request.output_token_ids + [token],
            score,
            beam.logprobs + [(token, logprob, rank)],
            token if token in self.stops else None,
        )

    def _continue(self, chosen: list) -> BeamStep:
        step, targets, used = BeamStep(num_tokens=len(chosen)), [], set()
        for _, b, _, _, _ in chosen:  # forks first: they copy their parent's tokens so far
            parent = self.beams[b].request
            if b in used:
                child = parent.copy_as(f"{self.completion_ids[0]}~beam{self.num_beams_made}")
                self.num_beams_made += 1
                step.forks.append((parent, child))
            targets.append(child if b in used else parent)
            used.add(b)
        beams = []
        for request, (score, b, token, logprob, rank) in zip(targets, chosen, strict=True):
            request.append_output_token(token)
            beams.append(Beam(request, score, self.beams[b].logprobs + [(token, logprob, rank)]))
        step.ended = [beam.request for b, beam in enumerate(self.beams) if b not in used]
        self.beams = beams
        return step

    def _done(self) -> BeamStep:
        outputs = []
        for i, completion_id in enumerate(self.completion_ids):
            if i >= len(self.finished):  # fewer candidates than beams (a tiny vocabulary)
                outputs.append(EngineCoreOutput(completion_id, [], "length"))
                continue
            h = self.finished[i]
            outputs.append(
                EngineCoreOutput(
                    completion_id,
                    h.token_ids,
                    "length" if h.stop_token is None else "stop",
                    h.stop_token if h.stop_token in self.stop_token_ids else None,
                    logprobs=[(t, {t: (lp, rank)}) for t, lp, rank in h.logprobs],
                    cumulative_logprob=float(h.cumulative_logprob),
                )
            )
        step = BeamStep(ended=[beam.request for beam in self.beams], outputs=outputs)
        self.beams = []
        return step


class BeamSearch:
    """The scheduler's beam groups: which request is a beam of which group, the beams'
    reports, and the parked beams. The scheduler calls it by name."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.group_of: dict[str, BeamGroup] = {}  # live beam id -> its group
        self.by_completion: dict[str, BeamGroup] = {}  # completion id -> its group
        self.parked: set[str] = set()
        self.ready: list[BeamGroup] = []

    def add(self, completions: list[Request]) -> Request:
        """A beam search whose best beams become `completions` (same prompt and params);
        returns its first beam, the request to queue."""
        first = completions[0]
        root = first.copy_as(f"{first.request_id}~beam0")
        group = BeamGroup(root, [c.request_id for c in completions], self.max_model_len)
        # Each beam reports its best `num_keep` tokens: enough for the best over all beams.
        # (Its group, not max_tokens, ends it.)
        root.sampling_params = dataclasses.replace(
            first.sampling_params, n=1, best_of=None, max_tokens=None, logprobs=group.num_keep
        )
        self.group_of[root.request_id] = group
        for c in completions:
            self.by_completion[c.request_id] = group
        return root

    def owns(self, request: Request) -> bool:
        return request.request_id in self.group_of

    def completion_id(self, request_id: str) -> str:
        """The id the user's request knows a beam by: its group's first completion's."""
        group = self.group_of.get(request_id)
        return request_id if group is None else group.completion_ids[0]

    def reported(self, request: Request) -> bool:
        group = self.group_of.get(request.request_id)
        return group is not None and request.request_id in group.reports

    def report(self, request: Request, logprobs) -> None:
        """A beam computed its last token; `logprobs` = (chosen id, {id: (logprob, rank)})
        holds its candidates."""
        group = self.group_of[request.request_id]
        if request.request_id in group.reports or request.num_computed_tokens != request.num_tokens:
            return  # computed again after a preemption: the same candidates
        group.reports[request.request_id] = logprobs[1]
        if group.ready:
            self.ready.append(group)

    def park(self, request: Request) -> bool:
        """A preempted beam that has reported waits for its group, in neither queue."""
        if self.reported(request):
            self.parked.add(request.request_id)
            return True
        return False

    def take_steps(self) -> list[BeamStep]:
        """The steps of the groups whose every beam has reported."""
        steps = []
        for group in self.ready:
            parked = [b.request for b in group.beams if b.request.request_id in self.parked]
            step = group.step()
            for parent, child in step.forks:
                self.group_of[child.request_id] = group
                holds = parent.status == RequestStatus.RUNNING
                (step.shared if holds else step.queued).append((parent, child) if holds else child)
            step.queued += [r for r in parked if r not in step.ended]
            self.parked.difference_update(r.request_id for r in parked)
            if step.outputs:
                for completion_id in group.completion_ids:
                    self.by_completion.pop(completion_id, None)
            steps.append(step)
        self.ready = []
        return steps

    def expand(self, request_ids) -> list[str]:
        """Request ids with each beam search's completion ids replaced by its live beams'
        (to end them all: the group is forgotten)."""
        out = []
        for request_id in request_ids:
            group = self.by_completion.get(request_id)
            if group is None:
                out.append(request_id)
                continue
            for completion_id in group.completion_ids:
                self.by_completion.pop(completion_id, None)
            out += [beam.request.request_id for beam in group.beams]
        return out

    def released(self, request: Request, finished: bool) -> None:
        if finished and self.group_of.pop(request.request_id, None) is not None:
            self.parked.discard(request.request_id)
