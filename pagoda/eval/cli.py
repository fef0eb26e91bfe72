"""`pagoda eval perplexity` and `pagoda quantize analyze`."""

from __future__ import annotations

import argparse
import dataclasses
import json


def register(sub: argparse._SubParsersAction) -> None:
    from pagoda.entrypoints.arg_utils import add_engine_args
    from pagoda.eval.perplexity import HELDOUT_TEXT

    evaluate = sub.add_parser("eval", help="model quality: perplexity")
    esub = evaluate.add_subparsers(dest="eval_command", required=True)
    ppl = esub.add_parser("perplexity", help="sliding-window perplexity over a text file")
    ppl.add_argument("model_tag", nargs="?", default=None, metavar="MODEL")
    ppl.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ppl.add_argument("--file", default=HELDOUT_TEXT, help="plain text (default: pagoda's own)")
    ppl.add_argument("--context", type=int, default=512, help="tokens a window holds")
    ppl.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    ppl.add_argument(
        "--llama-cpp-windows",
        action="store_true",
        help="score as llama.cpp's llama-perplexity: chunks of --context, second halves only",
    )
    ppl.add_argument("--output-json", default=None)
    ppl.add_argument("--no-progress", action="store_true")
    add_engine_args(ppl)
    ppl.set_defaults(func=cmd_perplexity)

    quantize = sub.add_parser("quantize", help="how quantization affects a model")
    qsub = quantize.add_subparsers(dest="quantize_command", required=True)
    analyze = qsub.add_parser(
        "analyze", help="perplexity change per layer group; suggests --keep-full-precision"
    )
    analyze.add_argument("model_tag", nargs="?", default=None, metavar="MODEL")
    analyze.add_argument("--model", default=None, help=argparse.SUPPRESS)
    analyze.add_argument("--file", default=HELDOUT_TEXT, help="plain text (default: pagoda's own)")
    analyze.add_argument("--by", choices=("kind", "layer"), default="kind")
    analyze.add_argument(
        "--target", type=float, default=0.01, help="largest perplexity rise to allow (0.01 = 1%%)"
    )
    analyze.add_argument("--context", type=int, default=512)
    analyze.add_argument("--stride", type=int, default=256)
    analyze.add_argument("--plot", default=None, help="PNG bar chart of the changes")
    analyze.add_argument("--output-json", default=None)
    add_engine_args(analyze)
    analyze.set_defaults(func=cmd_analyze)


def cmd_perplexity(ns: argparse.Namespace) -> int:
    from pagoda.entrypoints.arg_utils import engine_args_from
    from pagoda.eval.perplexity import as_record, perplexity

    ns.model = ns.model_tag or ns.model
    engine_kwargs = dataclasses.asdict(engine_args_from(ns))
    with open(ns.file, encoding="utf-8") as f:
        text = f.read()
    result = perplexity(
        engine_kwargs, text, ns.context, ns.stride, not ns.no_progress, ns.llama_cpp_windows
    )
    record = as_record(result, engine_kwargs, ns.file)
    how = "llama.cpp's halves" if ns.llama_cpp_windows else f"stride {ns.stride}"
    print(
        f"perplexity {result.perplexity:.4f} over {result.num_scored_tokens} tokens "
        f"({result.num_windows} windows of {ns.context}, {how}; {result.seconds:.1f} s)"
    )
    print(json.dumps(record, default=str))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return 0


def cmd_analyze(ns: argparse.Namespace) -> int:
    from pagoda.entrypoints.arg_utils import engine_args_from
    from pagoda.eval import sensitivity

    ns.model = ns.model_tag or ns.model
    engine_kwargs = dataclasses.asdict(engine_args_from(ns))
    with open(ns.file, encoding="utf-8") as f:
        text = f.read()
    print(f"quantizing one group at a time ({ns.by}), perplexity over {ns.file}:")
    report = sensitivity.analyze(engine_kwargs, text, ns.by, ns.target, ns.context, ns.stride)
    print()
    print(sensitivity.format_report(report))
    if ns.plot:
        sensitivity.plot_report(report, ns.plot)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(sensitivity.as_record(report, engine_kwargs), f, indent=1, default=str)
    return 0
