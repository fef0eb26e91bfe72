"""The `pagoda` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from pagoda import envs
from pagoda.config import TOOL_CALL_PARSERS
from pagoda.entrypoints.arg_utils import add_engine_args, engine_args_from


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)


def _sampling_params(ns: argparse.Namespace):
    from pagoda.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        output_kind=RequestOutputKind.DELTA,
    )


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagoda import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    params = _sampling_params(ns)
    prompts = ns.prompt
    images = []  # the files' bytes; the front door decodes and checks them
    for path in ns.image or ():
        with open(path, "rb") as f:
            images.append(f.read())
    if ns.chat:
        parts = [{"type": "image_pil", "image_pil": image} for image in images]
        outputs = llm.chat(
            [[{"role": "user", "content": [*parts, {"type": "text", "text": p}] if parts else p}]
             for p in prompts],
            params,
            use_tqdm=False,
        )  # fmt: skip
    elif images:
        outputs = llm.generate(
            [{"prompt": p, "multi_modal_data": {"image": images}} for p in prompts],
            params,
            use_tqdm=False,
        )
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text if ns.chat else (out.prompt or "") + out.outputs[0].text)
        if len(outputs) > 1:
            print("-" * 40)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from pagoda import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    engine = llm.llm_engine
    params = _sampling_params(ns)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("pagoda chat: type a message, Ctrl-D to quit.", file=sys.stderr)
    turn = 0
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user.strip():
            continue
        history.append({"role": "user", "content": user})
        request_id = f"chat-{turn}"
        turn += 1
        engine.add_request(request_id, {"messages": history}, params)
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text if out.outputs else ""
                print(text, end="", flush=True)
                reply += text
        print()
        history.append({"role": "assistant", "content": reply})


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        action="extend",
        default=None,
        help="name(s) the API answers to (default: the MODEL argument, or "
        "SmolLM2-135M-Instruct for the default model)",
    )
    parser.add_argument(
        "--api-key", default=None, help="require this bearer key on /v1 (or PAGODA_API_KEY)"
    )
    parser.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="most requests waiting to run; past it new ones get 503 (default: no limit)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=8 << 20,
        help="larger request bodies get 413 (default: 8 MiB)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve (with --enable-lora), each as NAME=PATH or a JSON "
        'object {"name", "path", "base_model_name"}; a request\'s model picks one',
    )
    parser.add_argument(
        "--request-log",
        default=None,
        metavar="PATH",
        help="append one JSON line per finished request (its timeline, token counts, "
        "cache hits, preemptions) to PATH, or - for stderr",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export one OpenTelemetry span per finished request over OTLP/HTTP to URL "
        "(e.g. http://127.0.0.1:4318/v1/traces; needs pip install 'pagoda[otel]')",
    )
    parser.add_argument(
        "--dashboard-interval",
        type=float,
        default=0.5,
        help="seconds between the /dashboard's samples of the engine (default: 0.5)",
    )
    parser.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="most /v1/responses kept for previous_response_id and GET; the oldest go "
        "first (default: 1000)",
    )
    parser.add_argument(
        "--stored-response-ttl",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="seconds a stored /v1/responses response is kept (default: 3600)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="hermes",
        help="the format the model writes tool calls in (vLLM's names; default: hermes)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: tool_choice 'auto' is always on",
    )
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="replicas of the engine, each on its share of the cores, behind a prefix "
        "router on --host/--port (vLLM's name; see pagoda router)",
    )
    many = parser.add_argument_group(
        "many models",
        "serve several models from this port, each loaded on its first request (any of "
        "--models-dir, --model NAME=PATH or --stored-models)",
    )
    many.add_argument(
        "--models-dir",
        default=None,
        metavar="DIR",
        help="serve the GGUF files and HF folders in DIR, named by file stem or folder",
    )
    many.add_argument(
        "--stored-models",
        action="store_true",
        help="serve the models already in the Hugging Face cache and Ollama's store, by "
        "their names there (see pagoda models)",
    )
    many.add_argument(
        "--max-loaded-models",
        type=int,
        default=4,
        metavar="N",
        help="most models loaded at once; the least recently used idle one is unloaded "
        "for another (default: 4)",
    )
    many.add_argument(
        "--keep-alive",
        type=float,
        default=None,
        metavar="SECONDS",
        help="unload a model idle this long (default: keep it until room is needed)",
    )


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        nargs="+",
        action="extend",  # --backend A --backend B: both (a plain list kept only B)
        metavar="URL",
        help="the replicas' base URLs",
    )
    parser.add_argument(
        "--discover-dns",
        default=None,
        metavar="HOST:PORT",
        help="replicas at every address HOST resolves to (a headless Kubernetes Service), "
        "looked up again at each health check",
    )
    parser.add_argument(
        "--discover-ray",
        action="store_true",
        help="replicas that `pagoda serve --data-parallel-size N --distributed-executor-backend "
        "ray` placed on the Ray cluster (RAY_ADDRESS, or this host's), looked up again at "
        "each health check",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        dest="backend",
        metavar="URL",
        help="with --policy pd: the decode replicas (the same list as --backend)",
    )
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        metavar="URL",
        help="with --policy pd: the prefill replicas (pagoda serve --kv-transfer-config "
        '\'{"kv_role": "kv_producer"}\' on a --kv-offload-dir the decode replicas share)',
    )
    parser.add_argument(
        "--policy", choices=("prefix", "round-robin", "least-loaded", "pd"), default="prefix"
    )  # router.POLICIES (not imported here: the CLI starts without the server's packages)
    parser.add_argument(
        "--model",
        default=None,
        help="the served model (its tokenizer and chat template, for prefix hashing; "
        "default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="the engines' block size")
    parser.add_argument(
        "--balance-threshold",
        type=int,
        default=64,
        help="in-flight difference past which the least loaded replica wins (prefix policy)",
    )
    parser.add_argument("--prefix-table-size", type=int, default=1 << 20, help="blocks kept")
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="follow each replica's prefix cache (its GET /kv_events stream: blocks stored "
        "and evicted) besides the router's own routing history",
    )
    parser.add_argument("--health-check-interval", type=float, default=2.0, help="seconds")


def cmd_serve(ns: argparse.Namespace) -> int:
    from pagoda.entrypoints.openai.api_server import run_server

    if ns.model_tag is not None and len(ns.model or []) == 1 and ns.model_tag != ns.model[0]:
        raise ValueError(f"two models named: {ns.model_tag!r} and --model {ns.model[0]!r}.")
    named = ns.model or []
    if ns.models_dir or ns.stored_models or len(named) > 1 or any("=" in m for m in named):
        if ns.model_tag is not None:
            raise ValueError(f"MODEL {ns.model_tag!r} with many models: name it --model NAME=PATH.")
        if ns.data_parallel_size != 1:
            raise ValueError("--data-parallel-size serves one model: not with many models.")
        from pagoda.entrypoints.multi_model.app import run_model_host

        return run_model_host(ns)
    ns.model = ns.model_tag or (named[0] if named else None)
    engine_args = engine_args_from(ns)  # checked here, before any replica starts
    if ns.data_parallel_size != 1:
        from pagoda.entrypoints.data_parallel import run_data_parallel

        engine_args.verify()
        return run_data_parallel(ns, ns.argv)
    return run_server(ns, engine_args)


def cmd_models(ns: argparse.Namespace) -> int:
    import json

    from pagoda.model_executor.model_catalog import catalog

    models = catalog(ns.model, ns.models_dir, stored=True)
    rows = [
        {"name": e.name, "size_bytes": e.size_bytes, "source": e.source, "path": e.path}
        for e in models.values()
    ]
    if ns.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no models found (--models-dir, the Hugging Face cache, Ollama's store)")
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        size = f"{r['size_bytes'] / (1 << 30):.2f} GiB"
        print(f"{r['name']:<{width}}  {size:>10}  {r['source']:<10}  {r['path']}")
    return 0


def cmd_router(ns: argparse.Namespace) -> int:
    from pagoda.entrypoints.router import RouterConfig, run_router

    return run_router(RouterConfig.from_namespace(ns))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda", description="pagoda: LLM inference and serving engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument(
        "--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap each prompt in the model's chat template (default: on)",
    )
    gen.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image file for every prompt (vision-language models; repeat for more); "
        "without --chat each prompt needs one <image> placeholder per image",
    )
    _sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streamed to the terminal")
    chat.add_argument("--model", default=None)
    chat.add_argument("--system", default=None, help="a system message")
    _sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    # No abbreviated options: --data-parallel-size hands the rest to its replicas whole.
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server", allow_abbrev=False)
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    serve.add_argument(
        "--model",
        action="append",
        metavar="PATH | NAME=PATH",
        help="the model (as MODEL); repeated or as NAME=PATH: many models, see below",
    )
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    models = sub.add_parser(
        "models",
        help="the models pagoda can serve by name: --models-dir, the Hugging Face cache, "
        "Ollama's store",
    )
    models.add_argument("--models-dir", default=None, metavar="DIR")
    models.add_argument("--model", action="append", metavar="NAME=PATH", help="also these")
    models.add_argument("--json", action="store_true", help="one JSON list")
    models.set_defaults(func=cmd_models)
    router = sub.add_parser(
        "router", help="one OpenAI endpoint routing by prompt prefix over several replicas"
    )
    add_router_args(router)
    router.set_defaults(func=cmd_router)
    from pagoda.bench.cli import register as register_bench
    from pagoda.eval.cli import register as register_eval
    from pagoda.sim.cli import register as register_sim

    register_bench(sub)
    register_eval(sub)
    register_sim(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.log_level(), format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    ns.argv = list(argv if argv is not None else sys.argv[1:])  # for replicas of `serve`
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
