"""The Ray executor: workers as Ray actors of a local cluster (`ray.init()` standing for a
multi-host one), outputs token for token those of one process; a dead actor stops
the engine."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import EngineDeadError
from tests.helpers import make_model, tiny_prompts

ray = pytest.importorskip("ray")

KV_BYTES = 40 * 2 * 2 * 16 * 2 * 16 * 4  # 40 blocks of the tiny llama's K/V (float32)


@pytest.fixture(scope="module")
def cluster():
    # Four logical CPUs on this machine's cores: room for TP=2 x PP=2, one CPU each.
    # "local": a new instance, not one a `ray start` on this host (or its leftovers) named.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("ray") / "llama"), "llama")


def _generate(model: str, prompts, params, **kwargs):
    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=KV_BYTES, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_ray_workers_match_one_process(cluster, model, tp, pp):
    from transformers import AutoTokenizer

    prompts = tiny_prompts(AutoTokenizer.from_pretrained(model), n=6, seed=5)
    for params in (
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.8, n=2, seed=3, ignore_eos=True),
    ):
        want = _generate(model, prompts, params)
        got = _generate(
            model, prompts, params, tensor_parallel_size=tp, pipeline_parallel_size=pp,
            distributed_executor_backend="ray",
        )  # fmt: skip
        assert got == want


def test_dead_ray_worker_stops_the_engine(cluster, model):
    llm = LLM(
        model, dtype="float32", kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )  # fmt: skip
    engine = llm.llm_engine
    actors = list(engine.model_runner.actors)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50))
    engine.step()
    ray.kill(actors[1])
    with pytest.raises(EngineDeadError, match="Ray worker died"):
        for _ in range(50):
            engine.step()
    assert engine.model_runner.actors == []  # the others were killed with it
    engine.shutdown()
