"""A vision-language model on the CPU: pagoda against Hugging Face transformers on the
same random LLaVA weights, and what the encoder cache saves.

    python benchmarks/vision.py [--requests 16] [--output-tokens 32]

The model, saved as a Hugging Face folder (nothing downloaded), has real shapes: a
CLIP ViT-B/16 tower at 224x224 (12 layers of 768; 196 image tokens an image) and a
SmolLM2-135M-shaped text model (30 layers of 576, 9 heads, 3 KV heads), in bf16
(the tests' small tokenizer stands in for a real one, so the vocabulary is small).

Workload: `--requests` chat-style prompts, each with its own 320x240 image, decode
`--output-tokens` tokens each (EOS ignored on both sides).
- HF: one batched `generate` (left padding) over all requests, HF's best case.
- pagoda: `LLM.generate` over the same prompts.
- pagoda, one shared image: the same prompts all with one image: the encoder cache
  runs it once, and the prefix cache holds the blocks of "<|user|><image>" after the
  first request, so only the short text after it is computed again.
Each figure is the best of three runs (pagoda's with new images each time, so
nothing is cached from the run before). Also the encoder's share of one request's prefill: `encode_images` for one image
against the time to the first token of one request alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.bench.report import machine_info  # noqa: E402
from tests.helpers import make_llava  # noqa: E402  (the tests' tiny tokenizer)

TEXT = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    initializer_range=0.02,
)
REPEATS = 3  # each figure is the best of three runs
TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)


def images(n: int, seed: int = 0):
    from PIL import Image

    rs = np.random.RandomState(seed)
    return [Image.fromarray(rs.randint(0, 256, (240, 320, 3), dtype=np.uint8)) for _ in range(n)]


def prompts_for(imgs) -> list[dict]:
    return [
        {"prompt": f"<|user|><image>Describe picture {i}.</s><|assistant|>",
         "multi_modal_data": {"image": img}}
        for i, img in enumerate(imgs)
    ]  # fmt: skip


def run_pagoda(llm: LLM, prompts: list[dict], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return elapsed


def run_hf(folder: str, prompts: list[dict], max_tokens: int) -> float:
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        folder, dtype=torch.bfloat16
    ).eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    start = time.perf_counter()
    enc = processor(
        text=[p["prompt"] for p in prompts],
        images=[p["multi_modal_data"]["image"] for p in prompts],
        return_tensors="pt",
        padding=True,
    )
    with torch.inference_mode():
        out = model.generate(
            **enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - enc["input_ids"].shape[1] == max_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.manual_seed(0)
    n, k = args.requests, args.output_tokens
    print(machine_info())
    with tempfile.TemporaryDirectory() as folder:
        make_llava(folder, "clip", TEXT, TOWER, image_size=224, patch_size=16)
        distinct, shared = prompts_for(images(n)), prompts_for(images(1, seed=7) * n)
        llm = LLM(folder, dtype="bfloat16")
        runner = llm.llm_engine.model_runner
        run_pagoda(llm, prompts_for(images(2, seed=9)), 2)  # warm-up
        before = runner.num_images_encoded
        t_pagoda = run_pagoda(llm, distinct, k)
        encoded = runner.num_images_encoded - before
        t_shared = run_pagoda(llm, shared, k)
        encoded_shared = runner.num_images_encoded - before - encoded
        # Best of REPEATS (these images are now cached: new ones each time).
        for r in range(1, REPEATS):
            t_pagoda = min(t_pagoda, run_pagoda(llm, prompts_for(images(n, seed=100 + r)), k))
            t_shared = min(t_shared, run_pagoda(llm, prompts_for(images(1, seed=200 + r) * n), k))
        # The encoder's share of one request's time to first token.
        (one,) = prompts_for(images(1, seed=5))
        pixels = llm.llm_engine.processor.images.hf_processor.image_processor(
            one["multi_modal_data"]["image"], return_tensors="pt"
        )["pixel_values"]
        runner.model.encode_images(pixels)
        start = time.perf_counter()
        for _ in range(5):
            runner.model.encode_images(pixels)
        t_encode = (time.perf_counter() - start) / 5
        t_ttft = run_pagoda(llm, [one], 1)
        del llm
        run_hf(folder, prompts_for(images(2, seed=9)), 2)  # warm-up
        t_hf = min(run_hf(folder, distinct, k) for _ in range(REPEATS))
    tokens = n * k
    print(f"\n{n} requests, one 320x240 image each (196 image tokens), {k} output tokens each\n")
    print("| engine | wall time | output tok/s | vs HF |")
    print("| --- | --- | --- | --- |")
    print(f"| HF transformers, one batched generate | {t_hf:.2f} s | {tokens / t_hf:.1f} | 1.00x |")
    print(f"| pagoda | {t_pagoda:.2f} s | {tokens / t_pagoda:.1f} | {t_hf / t_pagoda:.2f}x |")
    print(
        f"| pagoda, all {n} share one image | {t_shared:.2f} s | {tokens / t_shared:.1f} | "
        f"{t_hf / t_shared:.2f}x |"
    )
    print(
        f"\nimages encoded: {encoded} for {n} distinct images, {encoded_shared} for one "
        f"shared image (the encoder cache; the prefix cache also holds its blocks)"
    )
    print(
        f"one image through the encoder: {t_encode * 1e3:.1f} ms; one request's time to "
        f"first token: {t_ttft * 1e3:.1f} ms (encoder {100 * t_encode / t_ttft:.0f}%)"
    )
    if args.output_json:
        result = {
            "command": " ".join(["python", *sys.argv]), "machine": machine_info(),
            "requests": n, "output_tokens": k, "best_of": REPEATS,
            "wall_s": {"hf": t_hf, "pagoda": t_pagoda, "pagoda_shared_image": t_shared},
            "images_encoded": {"distinct": encoded, "shared": encoded_shared},
            "encode_ms": t_encode * 1e3, "ttft_ms": t_ttft * 1e3,
        }  # fmt: skip
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
