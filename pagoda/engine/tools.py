"""Tool calling in the Hermes format: checking tool definitions, putting them in the
prompt, the grammar that forces a call, and parsing calls out of the model's text.

The format (Hermes, Qwen2.5, SmolLM2's function-calling data): each call is a JSON
object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`
lines. A chat template that knows tools (it mentions `tools`) renders them itself;
for one that does not (SmolLM2-Instruct's), pagoda writes the tools into the system
message and earlier calls and results into the messages' text, in the same format.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagoda.errors import InvalidRequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _fail(param: str, why: str) -> None:
    raise InvalidRequestError(f"{param} {why}", param.split("[")[0].split(".")[0])


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's `tools`: [{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}]; returns them with `parameters` filled in."""
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        _fail("tools", f"must be a list of 1 to {MAX_TOOLS} tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            _fail(where, "must be an object with type 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict) or set(fn) - {"name", "description", "parameters", "strict"}:
            _fail(f"{where}.function", "must be an object of name, description, parameters, strict")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            _fail(f"{where}.function.name", "must be a string of 1 to 64 characters")
        if name in names:
            _fail(f"{where}.function.name", f"repeats {name!r}")
        names.add(name)
        if not isinstance(fn.get("description", ""), str):
            _fail(f"{where}.function.description", "must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            _fail(f"{where}.function.parameters", "must be a JSON schema object")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


# ---- the prompt ---------------------------------------------------------------------------


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def system_prompt(tools: list[dict]) -> str:
    """The tools as Hermes-style templates describe them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        f"within {OPEN}{CLOSE} XML tags:\n"
        f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
    )


def format_call(name: str, arguments: dict | str) -> str:
    args = arguments if isinstance(arguments, dict) else json.loads(arguments)
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def inline_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template that does not know tools: the tools in the system message, and
    earlier calls and results as text in the Hermes format."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join(
                format_call(c["function"]["name"], c["function"]["arguments"]) for c in calls
            )
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system_prompt(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": system_prompt(tools)})
    return out


# ---- forcing a call ----------------------------------------------------------------------------


def call_schema(tools: list[dict], name: str | None, args_key: str = "arguments") -> dict:
    """The JSON schema of one call of the named tool or any: {"name", args_key}."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, args_key: f["parameters"]},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
            for f in chosen
        ],
        "x-guidance": _JSON_LAYOUT,
    }


def tag(text: str, tag_ids: dict) -> str:
    """A Lark literal for `text`: its token where the tokenizer has it as one (the model
    writes it so; a string literal would force spelling it out)."""
    return f"<[{tag_ids[text]}]>" if text in tag_ids else json.dumps(text)


def call_grammar(tools: list[dict], name: str | None, parallel: bool, tag_ids: dict) -> str:
    """A Lark grammar (llguidance's dialect) for one Hermes call, or one or more with
    `parallel`, of the named tool or any: arguments that match the tool's schema.
    `tag_ids`: the open/close tags' token ids where the tokenizer has them as one token."""
    schema = json.dumps(call_schema(tools, name))
    call = f'{tag(OPEN, tag_ids)} "\\n" %json {schema} "\\n" {tag(CLOSE, tag_ids)}'
    start = 'call ("\\n" call)*' if parallel else "call"
    return f"start: {start}\ncall: {call}\n"


# ---- parsing calls out of the text --------------------------------------------------------------


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


def parsed_call(call: Any, names: set[str]) -> ParsedCall | None:
    """A call of one of `names` from its JSON object ({"name", "arguments"} or Llama's
    {"name", "parameters"}; arguments as an object or its JSON text), or None."""
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], arguments)


def partial_tag_len(text: str, tag: str = OPEN) -> int:
    """The length of the longest end of `text` that begins `tag` (held back while
    streaming: it may be the tag's start)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
