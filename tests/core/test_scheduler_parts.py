"""The scheduler's feature parts alone (core/scheduler_part.py and the parts beside the
loop): each driven through its own interface, with exact expectations."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

from pagoda.config import SpeculativeConfig
from pagoda.core.drafts import Drafts
from pagoda.core.encoder_cache import EncoderBudget
from pagoda.core.forks import Forks
from pagoda.core.grammar_admission import GrammarAdmission
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.lora_admission import MAX_STEPS_PASSED_OVER, LoRAAdmission
from pagoda.core.sched_output import ScheduledRequest
from pagoda.lora.request import LoRARequest
from pagoda.request import MultiModalFeature, Request, RequestStatus
from pagoda.sampling_params import SamplingParams


def request(rid: str, prompt: list[int], lora: int = 0, images=(), **params) -> Request:
    adapter = LoRARequest(f"a{lora}", lora, "/nowhere") if lora else None
    features = [MultiModalFeature(h, offset, length, None) for h, offset, length in images]
    return Request(rid, prompt, SamplingParams(**params), 0, 0.0, adapter, None, features)


# ---- the encoder budget ---------------------------------------------------------------


def test_encoder_budget_cuts_chunks_before_an_image_that_does_not_fit():
    images = EncoderBudget(budget=10)
    r = request("r", list(range(40)), images=[("x", 5, 6), ("y", 20, 6)])
    images.begin_step([], None)
    # Both images fit 10 rows? x (6) does; y (6 more) does not: the chunk ends before y.
    assert images.limit_tokens(r, 0, 40) == 20
    images.scheduled(r, 0, 20)
    assert images.step_budget == 4 and images.cache.holds("x") and not images.cache.holds("y")
    assert (images.queries, images.hits) == (1, 0)
    # A second request with x finds it held (a hit): nothing is charged for it.
    other = request("o", list(range(12)), images=[("x", 2, 6)])
    images.begin_step([], None)
    images.scheduled(other, 0, 12)
    assert (images.queries, images.hits, images.step_budget) == (2, 1, 10)
    # r is past x now, but `other` still needs it: y (6 more rows) does not fit the
    # cache (10) beside it, so r computes nothing this step.
    r.num_computed_tokens = 20
    images.computed(r)
    assert images.limit_tokens(r, 20, 20) == 0
    images.released(other, finished=True)  # x is needed by nobody: room, if evicted
    assert images.limit_tokens(r, 20, 20) == 20
    images.scheduled(r, 20, 20)
    assert images.cache.take_evicted() == ["x"] and images.cache.holds("y")
    images.released(r, finished=True)
    assert images.cache.users == {}


def test_an_image_larger_than_the_budget_runs_alone():
    images = EncoderBudget(budget=4)
    r = request("r", list(range(20)), images=[("big", 2, 8)])
    images.begin_step([], None)
    assert images.limit_tokens(r, 0, 20) == 20  # first in the step: it runs
    images.scheduled(r, 0, 20)
    late = request("l", list(range(20)), images=[("other", 0, 2)])
    assert images.limit_tokens(late, 0, 20) == 0  # nothing left this step


# ---- LoRA admission --------------------------------------------------------------------


def test_lora_admission_passes_over_then_drains_for_a_starving_head():
    loras = LoRAAdmission(max_loras=1)
    running = [request("r", [1], lora=1)]
    head = request("h", [1], lora=2)
    base, same = request("b", [1]), request("s", [1], lora=1)
    for _ in range(MAX_STEPS_PASSED_OVER):
        loras.begin_step(running, head)
        assert not loras.admits(head)
        assert loras.admits(base) and loras.admits(same)  # they pass the waiting head
    loras.begin_step(running, head)  # the head has waited too long
    assert loras.admits(base) and not loras.admits(same) and not loras.admits(head)
    loras.begin_step([], head)  # the running adapter drained
    assert loras.admits(head) and not loras.starving
    loras.scheduled(head, 0, 1)  # admitted: its adapter takes the slot
    assert not loras.admits(same) and loras.admits(request("h2", [1], lora=2))


def test_lora_stats_name_running_and_waiting_adapters():
    loras = LoRAAdmission(max_loras=2)
    a, b = request("a", [1], lora=1), request("b", [1], lora=2)
    a.status = RequestStatus.RUNNING
    stats = loras.stats([a, b])
    assert (stats.running_adapters, stats.waiting_adapters) == (("a1",), ("a2",))


# ---- grammar admission -----------------------------------------------------------------


class FakeGrammar:
    """A RequestGrammar stand-in: accepts tokens below 10; complete after token 9."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self.complete = False

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def accept(self, token_id: int) -> bool:
        self.complete = token_id == 9
        return token_id < 10


class FakeCompiler:
    def __init__(self) -> None:
        self.futures: list[Future] = []

    def request_grammar(self, grammar: str) -> FakeGrammar:
        self.futures.append(Future())
        return FakeGrammar(self.futures[-1])


def test_grammar_admission_waits_for_the_compile_and_reports_failures():
    compiler = FakeCompiler()
    grammars = GrammarAdmission(compiler)
    ok, bad = request("ok", [1]), request("bad", [1])
    for r in (ok, bad):
        r.sampling_params = dataclasses.replace(r.sampling_params, grammar="g")
        grammars.add(r)
    grammars.begin_step([], ok)
    assert not grammars.admits(ok) and grammars.compiling == [ok, bad]
    compiler.futures[0].set_result("compiled")
    compiler.futures[1].set_exception(ValueError("no such rule"))
    grammars.begin_step([], ok)
    assert grammars.admits(ok) and not grammars.admits(bad) and grammars.compiling == []
    assert grammars.take_failures() == {"bad": "no such rule"}
    assert grammars.take_failures() == {}
    assert grammars.admits(request("free", [1]))  # no grammar: nothing to wait for
    assert grammars.token_appended(ok, 3) is None
    assert grammars.token_appended(ok, 9) == RequestStatus.FINISHED_STOPPED
    assert grammars.token_appended(ok, 12) == RequestStatus.FINISHED_ERROR


def test_grammar_admission_forgets_an_aborted_request_still_compiling():
    grammars = GrammarAdmission(FakeCompiler())
    r = request("r", [1])
    r.sampling_params = dataclasses.replace(r.sampling_params, grammar="g")
    grammars.add(r)
    grammars.released(r, finished=False)  # preempted: still waits
    assert grammars.compiling == [r]
    grammars.released(r, finished=True)
    assert grammars.compiling == []


# ---- drafts ----------------------------------------------------------------------------


def test_drafts_are_proposed_within_room_and_grow_with_acceptance():
    drafts = Drafts(SpeculativeConfig(num_speculative_tokens=4), max_model_len=64)
    r = request("r", [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=10)
    r.num_computed_tokens = r.num_tokens - 1
    # What followed the last earlier "5 6": three tokens, the sequence's end.
    assert drafts.propose(r, r.num_tokens, budget=16, slots=64) == [7, 5, 6]
    assert drafts.propose(r, r.num_tokens - 1, budget=16, slots=64) == []  # a fork's leader
    assert drafts.propose(r, r.num_tokens, budget=3, slots=64) == [7, 5]  # budget - 1
    assert drafts.propose(r, r.num_tokens, budget=16, slots=r.num_tokens + 1) == [7]
    item = ScheduledRequest("r", [6, 7, 5, 6, 7], r.num_computed_tokens, [0], None,
                            num_draft_tokens=4)  # fmt: skip
    drafts.verified(r, item, num_sampled=2)  # one accepted, then a sampled token
    assert drafts.num_drafts_next["r"] == 2 and drafts.stats.num_accepted_tokens == 1
    drafts.released(r, finished=True)
    assert "r" not in drafts.num_drafts_next


def test_draft_model_inputs_start_where_its_cache_ends():
    drafts = Drafts(SpeculativeConfig(method="draft", num_speculative_tokens=2), 64)
    r = request("r", list(range(10)))
    r.num_computed_tokens, r.num_draft_computed = 9, 6
    assert drafts.propose(r, 10, budget=8, slots=64) == [0, 0]  # placeholders
    assert drafts.inputs(r, 10, [0, 0]) == ([6, 7, 8, 9], 6)
    assert drafts.inputs(r, 10, []) == ([], 6)


# ---- forks -----------------------------------------------------------------------------


def test_forks_share_the_leaders_blocks_at_its_fork_point():
    kv = KVCacheManager(16, 4, True)
    forks = Forks(kv)
    leader = request("x#0", list(range(9)))
    siblings = [request("x#1", list(range(9))), request("x#2", list(range(9)))]
    forks.add(leader, siblings)
    assert forks.token_limit(leader) == 8 and forks.token_limit(siblings[0]) == 9
    assert kv.allocate_slots(leader, 8) is not None
    leader.num_computed_tokens = 5
    assert forks.fork_if_ready(leader) == []  # not there yet
    leader.num_computed_tokens = 8
    assert forks.fork_if_ready(leader) == siblings
    for s in siblings:
        assert s.status == RequestStatus.RUNNING and s.num_computed_tokens == 8
        assert kv.get_block_ids(s.request_id) == kv.get_block_ids(leader.request_id)
    assert forks.token_limit(leader) == 9  # a plain request from now on


def test_a_leader_that_leaves_early_hands_its_siblings_back():
    forks = Forks(KVCacheManager(16, 4, True))
    leader, a, b = (request(f"x#{i}", [1, 2, 3]) for i in range(3))
    forks.add(leader, [a, b])
    assert forks.drop_sibling(a) and not forks.drop_sibling(a)
    assert forks.leader_left(leader) == [b] and forks.leader_left(leader) == []
