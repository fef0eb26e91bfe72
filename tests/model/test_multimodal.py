"""Vision-language models: LLaVA (CLIP and SigLIP encoders) against Hugging Face
transformers, token for token (greedy, float32), with images and text-only prompts in
one batch, chunked prefill splitting images, preemption, the encoder cache and the
prefix cache; and the front door's refusals of bad images."""

from __future__ import annotations

import base64

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.errors import InvalidRequestError
from tests.helpers import MM_GREEDY, MM_MAX_TOKENS, data_uri, image, make_llava

KV_BLOCK_BYTES = 2 * 16 * 2 * 16 * 2 * 4  # layers, block size, KV heads, head dim, K and V, fp32


def mixed_prompts() -> list[dict]:
    """10 prompts: 7 with images (different sizes, one with two, one with the same image
    twice, images shared between prompts), 3 text-only."""
    imgs = [image(i, (30 + 9 * i, 60 - 5 * i)) for i in range(5)]
    prompts = [
        {"prompt": f"Describe <image> please {i}", "multi_modal_data": {"image": imgs[i]}}
        for i in range(4)
    ]
    prompts += [
        {"prompt": "The quick brown fox jumps over the lazy dog."},
        {
            "prompt": "Compare <image> with <image> now",
            "multi_modal_data": {"image": [imgs[4], imgs[1]]},
        },
        {"prompt": "Hello world, how are you today?"},
        {"prompt": "<image> first, text after", "multi_modal_data": {"image": [imgs[2]]}},
        {"prompt": "Paged attention keeps the KV cache in blocks."},
        {"prompt": "<image> and again <image>", "multi_modal_data": {"image": [imgs[3]] * 2}},
    ]
    return prompts


def hf_greedy(folder: str, prompts: list[dict]) -> list[list[int]]:
    import transformers

    hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    out = []
    for p in prompts:
        images = p.get("multi_modal_data", {}).get("image")
        enc = processor(text=p["prompt"], images=images, return_tensors="pt")
        with torch.inference_mode():
            ids = hf.generate(**enc, max_new_tokens=MM_MAX_TOKENS, do_sample=False)
        out.append(ids[0, enc["input_ids"].shape[1] :].tolist())
    return out


@pytest.fixture(scope="module", params=["clip", "siglip"])
def llava(request, tmp_path_factory) -> tuple[str, list[list[int]]]:
    """(folder, HF's greedy tokens for mixed_prompts())."""
    folder = make_llava(str(tmp_path_factory.mktemp(f"llava-{request.param}")), request.param)
    return folder, hf_greedy(folder, mixed_prompts())


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        # Chunks of 16 tokens: images (25 tokens) split across steps, and the encoder
        # budget (16) below one image, so each step encodes at most one.
        {"max_num_batched_tokens": 16},
        {"enable_prefix_caching": False, "max_num_seqs": 3},
    ],
    ids=["default", "chunked", "no-prefix-cache"],
)
def test_batch_matches_hf(llava, engine_kwargs):
    folder, expected = llava
    llm = LLM(folder, dtype="float32", **engine_kwargs)
    assert tokens(llm.generate(mixed_prompts(), MM_GREEDY, use_tqdm=False)) == expected
    runner = llm.llm_engine.model_runner
    assert runner.num_images_encoded >= 5  # 5 distinct images


def test_preemption_keeps_outputs_exact(llava):
    folder, expected = llava
    # 12 blocks of 16 tokens: the 9 prompts (each 2-4 blocks with its output) cannot all
    # run at once, so requests are preempted and recompute their images.
    llm = LLM(folder, dtype="float32", kv_cache_memory_bytes=12 * KV_BLOCK_BYTES)
    assert llm.llm_engine.model_runner.num_blocks == 12
    outputs = llm.generate(mixed_prompts(), MM_GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_swap_preemption_keeps_outputs_exact(llava):
    folder, expected = llava
    llm = LLM(
        folder,
        dtype="float32",
        kv_cache_memory_bytes=12 * KV_BLOCK_BYTES,
        preemption_mode="swap",
    )
    assert tokens(llm.generate(mixed_prompts(), MM_GREEDY, use_tqdm=False)) == expected
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_shared_image_is_encoded_once(tiny_llava):
    llm = LLM(tiny_llava, dtype="float32")
    img = image(7)
    prompts = [
        {"prompt": f"Question {i}: <image> what is it?", "multi_modal_data": {"image": img}}
        for i in range(4)
    ]
    outputs = llm.generate(prompts, MM_GREEDY, use_tqdm=False)
    assert llm.llm_engine.model_runner.num_images_encoded == 1
    stats = llm.llm_engine.get_stats()
    assert (stats.mm_cache_queries, stats.mm_cache_hits) == (4, 3)
    # The same image as a copy (another object, same pixels) is the same image.
    again = llm.generate(
        [{"prompt": "Question 0: <image> what is it?", "multi_modal_data": {"image": img.copy()}}],
        MM_GREEDY,
        use_tqdm=False,
    )
    assert tokens(again)[0] == tokens(outputs)[0]
    assert llm.llm_engine.model_runner.num_images_encoded == 1


def test_prefix_cache_keys_blocks_by_image(tiny_llava):
    """The same text with another image shares only the blocks before the image."""
    llm = LLM(tiny_llava, dtype="float32", block_size=16)
    text = "The quick brown fox jumps over the lazy dog. <image> Paged attention keeps blocks."

    def run(img):
        (out,) = llm.generate(
            [{"prompt": text, "multi_modal_data": {"image": img}}], MM_GREEDY, use_tqdm=False
        )
        return out

    first = run(image(1))
    image_start = first.prompt_token_ids.index(llm.llm_engine.processor.images.image_token_id)
    other = run(image(2))
    assert other.num_cached_tokens == image_start // 16 * 16  # blocks wholly before the image
    same = run(image(1))
    assert same.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16
    assert same.num_cached_tokens > other.num_cached_tokens
    assert tokens([same]) == tokens([first])
    assert tokens([other]) != tokens([first])  # another image: another answer
    assert tokens([other]) == hf_greedy(
        tiny_llava, [{"prompt": text, "multi_modal_data": {"image": image(2)}}]
    )


def test_chat_with_image_parts(tiny_llava):
    llm = LLM(tiny_llava, dtype="float32")
    img = image(3)
    expected = tokens(
        llm.generate(
            [{"prompt": "<|user|><image>What is this?</s><|assistant|>",
              "multi_modal_data": {"image": img}}],
            MM_GREEDY,
            use_tqdm=False,
        )
    )  # fmt: skip
    for part in (
        {"type": "image_url", "image_url": {"url": data_uri(img)}},
        {"type": "image_url", "image_url": data_uri(img)},
        {"type": "image_pil", "image_pil": img},
    ):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
        (out,) = llm.chat(messages, MM_GREEDY, use_tqdm=False)
        assert out.prompt == "<|user|><image>What is this?</s><|assistant|>"
        assert tokens([out]) == expected


def test_bad_images_are_refused_and_the_engine_serves_on(tiny_llava, tiny_llama):
    from PIL import Image

    llm = LLM(tiny_llava, dtype="float32", limit_mm_per_prompt={"image": 2})
    img = image(0)

    def refused(prompt, param, match):
        with pytest.raises(InvalidRequestError, match=match) as e:
            llm.generate([prompt], MM_GREEDY, use_tqdm=False)
        assert e.value.param == param
        assert isinstance(e.value, ValueError)

    mm = "multi_modal_data"
    refused({"prompt": "a <image> b <image>", mm: {"image": img}}, "prompt", "2 image placeholder")
    refused({"prompt": "no placeholder", mm: {"image": img}}, "prompt", "0 image placeholder")
    refused({"prompt": "a <image>"}, "prompt", "1 image placeholder")
    refused({"prompt": "<image>" * 3, mm: {"image": [img] * 3}}, mm, "at most 2 are allowed")
    refused({"prompt": "a <image>", mm: {"image": b"not an image"}}, mm, "could not be decoded")
    refused({"prompt": "a <image>", mm: {"image": "data:image/png;base64,@@@"}}, mm, "malformed")
    refused({"prompt": "a <image>", mm: {"image": 42}}, mm, "must be an image")
    refused({"prompt": "a <image>", mm: {"video": img}}, mm, "must be")
    huge = Image.new("RGB", (4097, 4097))
    refused({"prompt": "a <image>", mm: {"image": huge}}, mm, "4097x4097 pixels")
    png = base64.b64decode(data_uri(img).split(",", 1)[1])
    truncated = "data:image/png;base64," + base64.b64encode(png[: len(png) // 2]).decode()
    refused({"prompt": "a <image>", mm: {"image": truncated}}, mm, "could not be decoded")
    image_id = llm.llm_engine.processor.images.image_token_id
    refused({"prompt_token_ids": [5, image_id, 6]}, "prompt_token_ids", "image token")

    def chat_refused(part, match):
        with pytest.raises(InvalidRequestError, match=match) as e:
            llm.chat([{"role": "user", "content": [part]}], MM_GREEDY, use_tqdm=False)
        assert e.value.param == "messages"

    remote = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    chat_refused(remote, r"messages\[0\]\.content\[0\]\.image_url is a remote URL")
    chat_refused({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "data: URI")
    chat_refused({"type": "video_url", "video_url": {"url": "x"}}, "must be")
    chat_refused({"type": "text"}, "must be")  # a part without its value
    chat_refused({"type": "image_url"}, "must be")
    chat_refused({"type": "image_url", "image_url": {"url": "http://[x/a.png"}}, "well-formed URL")
    chat_refused({"type": "image_pil", "image_pil": "https://example.com/a.png"}, "PIL image")
    strip = Image.new("RGB", (2, 200))
    chat_refused({"type": "image_pil", "image_pil": strip}, "at most 50 times the shorter")
    with pytest.raises(InvalidRequestError, match="content") as e:
        llm.chat([{"role": "user", "content": 42}], MM_GREEDY, use_tqdm=False)
    assert e.value.param == "messages"
    # Three images in one conversation, over the limit of two.
    three = [{"type": "image_pil", "image_pil": img}] * 3
    with pytest.raises(InvalidRequestError, match="more than 2 images"):
        llm.chat([{"role": "user", "content": three}], MM_GREEDY, use_tqdm=False)
    # The engine serves on, and nothing was left queued.
    (out,) = llm.generate([{"prompt": "a <image>", mm: {"image": img}}], MM_GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids
    assert not llm.llm_engine.has_unfinished_requests()
    # A text-only model refuses images with a clear error.
    text_llm = LLM(tiny_llama, dtype="float32")
    with pytest.raises(InvalidRequestError, match="takes no images") as e:
        text_llm.generate([{"prompt": "a", mm: {"image": img}}], MM_GREEDY, use_tqdm=False)
    assert e.value.param == mm
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text_llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img}]}])


def test_encoder_cache_manager_evicts_only_unused():
    from pagoda.core.encoder_cache import EncoderCacheManager

    cache = EncoderCacheManager(capacity=50)
    cache.add("a", 25)
    cache.use("a", "r1")
    cache.add("b", 25)
    cache.use("b", "r2")
    assert not cache.can_hold(25)  # both needed
    cache.release("a", "r1")
    assert cache.can_hold(25)
    cache.add("c", 25)  # evicts a, the one nobody needs
    assert cache.take_evicted() == ["a"]
    assert cache.holds("b") and cache.holds("c") and not cache.holds("a")
    # An output larger than the cache fits once nothing else is needed.
    cache.use("c", "r3")
    assert not cache.can_hold(60)
    cache.release("c", "r3")
    assert not cache.can_hold(60)  # b is still needed
    cache.release("b", "r2")
    assert cache.can_hold(60)
    cache.add("d", 60)
    assert sorted(cache.take_evicted()) == ["b", "c"] and cache.num_used == 60
    # An unneeded output that a request is about to take again is not room.
    cache.use("d", "r4")
    cache.release("d", "r4")
    assert cache.can_hold(30) and not cache.can_hold(30, keep={"d"})


def test_quantized_text_model_keeps_the_vision_tower_float(tiny_llava):
    llm = LLM(tiny_llava, dtype="float32", quantization="int8")
    model = llm.llm_engine.model_runner.model
    assert model.language_model.model.layers[0].self_attn.qkv_proj.qweight is not None
    tower = dict(model.vision_tower.named_parameters())
    assert tower and all(p.dtype == torch.float32 for p in tower.values())
    assert model.multi_modal_projector.linear_1.weight.dtype == torch.float32
    (out,) = llm.generate(
        [{"prompt": "a <image> b", "multi_modal_data": {"image": image(0)}}],
        MM_GREEDY,
        use_tqdm=False,
    )
    assert len(out.outputs[0].token_ids) > 0


def test_lora_on_a_vision_language_model_is_refused(tiny_llava):
    with pytest.raises(ValueError, match="vision-language models are not supported"):
        LLM(tiny_llava, enable_lora=True)


def test_generate_command_takes_image_files(tiny_llava, tmp_path, capsys):
    from pagoda.entrypoints.cli import main

    path = tmp_path / "picture.png"
    image(4).save(path)
    messages = [
        {"role": "user", "content": [{"type": "image_pil", "image_pil": image(4)},
                                     {"type": "text", "text": "What is this?"}]}
    ]  # fmt: skip
    (expected,) = LLM(tiny_llava, dtype="float32").chat(messages, MM_GREEDY, use_tqdm=False)
    args = ["generate", "--model", tiny_llava, "--dtype", "float32", "--max-tokens", "10"]
    assert main([*args, "--image", str(path), "What is this?"]) == 0
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"
    assert main([*args, "--image", str(tmp_path / "missing.png"), "x"]) == 2
    assert main([*args, "--no-chat", "--image", str(path), "no placeholder"]) == 2
    assert "0 image placeholder(s)" in capsys.readouterr().err


def test_parallel_sampling_and_speculation_with_images(tiny_llava):
    """n > 1 siblings fork after the image and share its blocks; n-gram drafts verify
    on a prompt with an image; greedy outputs stay the plain run's."""
    prompts = mixed_prompts()[:4]
    plain = tokens(LLM(tiny_llava, dtype="float32").generate(prompts, MM_GREEDY, use_tqdm=False))
    llm = LLM(tiny_llava, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(n=3, max_tokens=MM_MAX_TOKENS, temperature=0.0),
                        use_tqdm=False)  # fmt: skip
    for out, expected in zip(outs, plain, strict=True):
        assert [list(c.token_ids) for c in out.outputs] == [expected] * 3
    assert llm.llm_engine.model_runner.num_images_encoded == 4
    spec = LLM(tiny_llava, dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "disable_by_batch_size": 8})  # fmt: skip
    long = SamplingParams(max_tokens=40, temperature=0.0)
    assert tokens(spec.generate(prompts, long, use_tqdm=False)) == tokens(
        LLM(tiny_llava, dtype="float32").generate(prompts, long, use_tqdm=False)
    )
    assert spec.llm_engine.get_stats().spec_decoding.num_draft_tokens > 0


def test_parallel_sampling_with_a_cached_fork_point(tiny_llava):
    """n = 2 on a prompt whose fork point (all but its last token) is whole blocks the
    prefix cache already holds: the leader has nothing to compute and must still fork."""
    llm = LLM(tiny_llava, dtype="float32", block_size=16)
    images = llm.llm_engine.processor.images
    text = next(
        t
        for t in (f"<image>{' a' * k}" for k in range(40))
        if (len(images.process(t, [image(8)], "prompt")[0]) - 1) % 16 == 0
    )
    prompt = {"prompt": text, "multi_modal_data": {"image": image(8)}}
    params = SamplingParams(n=2, max_tokens=4, temperature=0.0)
    engine = llm.llm_engine
    for round_ in range(2):  # the second finds the fork point cached
        engine.add_request(f"r{round_}", prompt, params)
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        assert not engine.has_unfinished_requests(), f"round {round_} did not finish"
    assert engine.get_stats().kv_cache.prefix_cache_hits > 0
