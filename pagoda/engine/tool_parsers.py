"""Tool calls in the formats models write them (`--tool-call-parser`, vLLM's names):

- `hermes` (the default; Hermes, Qwen2.5/3, SmolLM2): `<tool_call>{"name", "arguments"}</tool_call>`
  anywhere in the text (`pagoda.engine.tools.ToolCallParser`);
- `llama3_json` (Llama 3.1-3.3): the whole output is one or more JSON objects
  `{"name", "parameters"}`, `;`-separated, maybe after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (or the
  newer `[TOOL_CALLS]name[ARGS]{...}`), content before the marker;
- `pythonic` (Llama 3.2/4, ToolACE): the whole output is a Python list of calls,
  `[get_weather(city="Oslo"), get_time(zone=1)]`, read with `ast` (literals only).

Each parser splits the text into (content, calls completed) as it streams, and
whole responses feed all the text at once, so both are the same parse. Text that
looked like the start of calls but does not parse as them is content. A call goes
out whole once it has parsed (its arguments in one delta).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagoda.engine.tools import (
    ParsedCall,
    ToolCallParser,
    call_grammar,
    call_schema,
    parsed_call,
    partial_tag_len,
    tag,
)
from pagoda.errors import InvalidRequestError


class WholeOutputParser:
    """Formats whose calls are the whole output: decided by how it starts (`opens`),
    then held until it parses (`parse`: the calls, or None while it does not)."""

    prefixes: tuple[str, ...] = ()

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.buffer = ""
        self.mode = "start"  # "start" (undecided), "calls" or "content"
        self.num_sent = 0  # calls already returned

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        if self.mode == "start":
            head = self.buffer.lstrip()
            if any(head.startswith(p) for p in self.prefixes):
                self.mode = "calls"
            elif head and not any(p.startswith(head) for p in self.prefixes):
                self.mode = "content"
            else:
                return "", []  # too little yet to tell
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", self._new_calls(self.parse(self.buffer, final=False))

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.buffer = self.buffer, ""
        if self.mode != "calls":
            return rest, []
        calls = self.parse(rest, final=True)
        if calls is None:
            return ("", []) if self.num_sent else (rest, [])  # not calls after all
        return "", self._new_calls(calls)

    def _new_calls(self, calls: list[ParsedCall] | None) -> list[ParsedCall]:
        """The calls not returned before (a parse never loses calls it had)."""
        new = (calls or [])[self.num_sent :]
        self.num_sent += len(new)
        return new

    def parse(self, text: str, final: bool) -> list[ParsedCall] | None:
        raise NotImplementedError


class Llama3JsonParser(WholeOutputParser):
    prefixes = ("<|python_tag|>", "{")

    def parse(self, text: str, final: bool) -> list[ParsedCall] | None:
        """The calls whose objects are complete (all of them, when `final`)."""
        text = text.lstrip().removeprefix("<|python_tag|>")
        calls, i, decoder = [], 0, json.JSONDecoder()
        while True:
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
            if i == len(text):
                return calls
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return None if final else calls
            call = parsed_call(obj, self.names)
            if call is None:
                return None
            calls.append(call)


class PythonicParser(WholeOutputParser):
    prefixes = ("<|python_start|>", "[")

    def parse(self, text: str, final: bool) -> list[ParsedCall] | None:
        text = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        if not final and not text.endswith("]"):
            return None
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List):
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return None
            call = parsed_call({"name": node.func.id, "arguments": args}, self.names)
            if call is None:
                return None
            calls.append(call)
        return calls


class MistralParser:
    """Content until `[TOOL_CALLS]`; after it, the calls."""

    MARKER = "[TOOL_CALLS]"

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.buffer = ""
        self.in_calls = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        if self.in_calls:
            return "", []
        start = self.buffer.find(self.MARKER)
        if start >= 0:
            content, self.buffer = self.buffer[:start], self.buffer[start + len(self.MARKER) :]
            self.in_calls = True
            return content, []
        keep = partial_tag_len(self.buffer, self.MARKER)
        content, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]  # fmt: skip
        return content, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_calls:
            return rest, []
        calls = self._parse(rest.strip())
        return ("", calls) if calls is not None else (self.MARKER + rest, [])

    def _parse(self, text: str) -> list[ParsedCall] | None:
        objs: Any
        if text.startswith("["):
            try:
                objs = json.loads(text)
            except json.JSONDecodeError:
                return None
            objs = objs if isinstance(objs, list) else None
        else:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            objs = []
            for part in text.split(self.MARKER):
                name, sep, args = part.partition("[ARGS]")
                if not sep:
                    return None
                try:
                    objs.append({"name": name.strip(), "arguments": json.loads(args)})
                except json.JSONDecodeError:
                    return None
        calls = [parsed_call(o, self.names) for o in objs or []]
        return calls if calls and None not in calls else None


_PARSERS = {
    "hermes": ToolCallParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}


def forced_call_grammar(
    parser: str, tools: list[dict], name: str | None, parallel: bool, tag_ids: dict
) -> str:
    """The grammar that forces a call (tool_choice "required" or a named function) in
    `parser`'s format; `tag_ids`: its markers' token ids where they are one token."""
    if parser == "hermes":
        return call_grammar(tools, name, parallel, tag_ids)
    if parser == "llama3_json":
        call = f"%json {json.dumps(call_schema(tools, name, 'parameters'))}"
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {call}\n"
    if parser == "mistral":
        items = {"type": "array", "items": call_schema(tools, name), "minItems": 1}
        if not parallel:
            items["maxItems"] = 1
        return f"start: {tag(MistralParser.MARKER, tag_ids)} %json {json.dumps(items)}\n"
    raise InvalidRequestError(
        f"tool_choice: forcing a call is not supported with the {parser} tool-call parser; "
        "use 'auto'",
        "tool_choice",
    )


def make_tool_parser(name: str, tool_names: list[str]):
    """A fresh parser of format `name` (one of TOOL_CALL_PARSERS) for one output."""
    return _PARSERS[name](tool_names)
