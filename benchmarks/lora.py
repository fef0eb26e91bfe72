"""Multi-LoRA throughput: the base model alone against the same workload under one
adapter and spread over many, one command.

    python benchmarks/lora.py [--model M] [--num-adapters 8] [--rank 16]
                              [--output-json docs/perf/lora.json]

- `uniform` (256 requests, 128 prompt and 128 output tokens, all at once) on the
  base model, then every request under one adapter, then requests spread round-robin
  over `--num-adapters` adapters (max_loras = that many, so one step serves them all);
- batch 1 (one request at a time, 128 output tokens): base against one adapter.

The three `uniform` runs go in rounds (`--rounds`, default 2: base, one, many, then
again), so that a drift of the shared machine falls on all of them; each ratio is
the median over rounds of that round's ratio.

Adapters are random, rank `--rank`, on every linear layer (q/k/v/o/gate/up/down),
written in PEFT's format to a temporary folder. Each run is its own process
(pagoda.bench.throughput.run_pagoda); figures are ratios within this one command;
name the CPU with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

from pagoda.bench.report import machine_info, versions
from pagoda.bench.throughput import in_subprocess
from pagoda.bench.workloads import make_workload
from pagoda.lora import LoRARequest
from pagoda.lora.adapter import TARGET_MODULES, module_shapes
from pagoda.model_executor.model_files import load_tokenizer, resolve_model
from pagoda.model_executor.model_loader import load_hf_config


def write_adapter(folder: str, hf_config: dict, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter on every linear of every layer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for module, (in_features, out_features) in module_shapes(hf_config).items():
            key = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
            state[f"{key}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=g) / in_features**0.5
            )
            state[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(state, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": list(TARGET_MODULES)}  # fmt: skip
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args()
    path, is_gguf = resolve_model(ns.model)
    tokenizer = load_tokenizer(path, is_gguf)
    hf_config = load_hf_config(path, is_gguf)
    uniform = make_workload("uniform", tokenizer, num_prompts=ns.num_prompts)
    single = make_workload("uniform", tokenizer, num_prompts=4)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(f"adapter{i}", i, write_adapter(f"{tmp}/a{i}", hf_config, ns.rank, i))
            for i in range(1, ns.num_adapters + 1)
        ]
        lora_args = {"enable_lora": True, "max_lora_rank": ns.rank}

        def run(label: str, reqs, loras=None, **engine_kwargs) -> dict:
            engine_kwargs = {"model": ns.model, **engine_kwargs}
            result = in_subprocess(
                "run_pagoda",
                engine_kwargs=engine_kwargs,
                reqs=reqs,
                progress=False,
                lora_requests=loras,
            )
            result.update(config=label)
            del result["per_request"]  # 256 requests' latencies: the summaries suffice here
            rows.append(result)
            print(
                f"{label:34} {result['output_throughput']:8.1f} out tok/s   "
                f"TPOT mean {result['tpot_ms']['mean']:7.2f} ms",
                flush=True,
            )
            return result

        spread = [adapters[i % len(adapters)] for i in range(len(uniform))]
        one_ratios, many_ratios = [], []
        for r in range(1, ns.rounds + 1):
            base = run(f"uniform, base model (round {r})", uniform)
            one = run(f"uniform, 1 adapter (round {r})", uniform, [adapters[0]] * len(uniform),
                      **lora_args)  # fmt: skip
            many = run(
                f"uniform, {len(adapters)} adapters (round {r})",
                uniform,
                spread,
                max_loras=len(adapters),
                **lora_args,
            )
            one_ratios.append(one["output_throughput"] / base["output_throughput"])
            many_ratios.append(many["output_throughput"] / base["output_throughput"])
        b1 = run("batch 1, base model", single, max_num_seqs=1)
        b1_lora = run(
            "batch 1, 1 adapter", single, [adapters[0]] * len(single), max_num_seqs=1, **lora_args
        )
    summary = {
        "one_adapter_vs_base": statistics.median(one_ratios),
        "many_adapters_vs_base": statistics.median(many_ratios),
        "batch1_tpot_ratio": b1_lora["tpot_ms"]["mean"] / b1["tpot_ms"]["mean"],
    }
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")
    if ns.output_json:
        record = {"machine": machine_info(), "versions": versions(), "summary": summary}
        record["settings"] = {"num_adapters": ns.num_adapters, "rank": ns.rank, "model": ns.model,
                              "num_prompts": ns.num_prompts, "rounds": ns.rounds}  # fmt: skip
        record["summary"]["ratios_per_round"] = {"one": one_ratios, "many": many_ratios}
        with open(ns.output_json, "w") as f:
            json.dump({**record, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
