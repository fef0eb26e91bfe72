"""Tool calls in the formats models write them (`--tool-call-parser`, vLLM's names):

- `hermes` (the default; Hermes, Qwen2.5/3, SmolLM2): `<tool_call>{"name", "arguments"}</tool_call>`
  anywhere in the text;
- `llama3_json` (Llama 3.1-3.3): the whole output is one or more JSON objects
  `{"name", "parameters"}`, `;`-separated, maybe after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (or the
  newer `[TOOL_CALLS]name[ARGS]{...}`), content before the marker;
- `pythonic` (Llama 3.2/4, ToolACE): the whole output is a Python list of calls,
  `[get_weather(city="Oslo"), get_time(zone=1)]`, read with `ast` (literals only).

Each parser splits the text into (content, pieces of calls) as it streams, and
whole responses feed all the text at once, so both are the same parse. A call's
arguments stream as the model writes them once its name is read
(`pagoda.engine.call_stream`; pythonic calls go out whole, their arguments turned
from Python into JSON). Text that looked like the start of calls but is not a call
is content.
"""

from __future__ import annotations

import ast
import json

from pagoda.engine.call_stream import CallDelta, CallStream, whole_call
from pagoda.engine.tools import (
    CLOSE,
    OPEN,
    ParsedCall,
    call_grammar,
    call_schema,
    parsed_call,
    partial_tag_len,
    tag,
)
from pagoda.errors import InvalidRequestError


class HermesParser:
    """Calls between `<tool_call>` and `</tool_call>`, anywhere in the text."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.buffer = ""
        self.call: CallStream | None = None  # the open call
        self.body = ""  # the open call's text so far
        self.num_calls = 0
        self.held = ""  # trailing whitespace, sent only if more content follows
        self.before_call = ""  # whitespace before the open call: dropped if it is one

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if self.call is not None:
                end = self.buffer.find(CLOSE)
                cut = end if end >= 0 else len(self.buffer) - partial_tag_len(self.buffer, CLOSE)
                self.body += self.buffer[:cut]
                deltas += self.call.feed(self.buffer[:cut])
                if end < 0:
                    self.buffer = self.buffer[cut:]
                    break
                self.buffer = self.buffer[end + len(CLOSE) :]
                last = self._end_call()
                if last is None:  # not a call after all: it was text
                    content += self.before_call + OPEN + self.body + CLOSE
                deltas += last or []
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                # Whitespace right before a call is dropped if it is one, however the
                # text was split; kept if it is not.
                before = content + self.buffer[:start]
                content = before.rstrip()
                self.before_call = before[len(content) :]
                if not content:
                    self.before_call, self.held = self.held + self.before_call, ""
                self.buffer = self.buffer[start + len(OPEN) :]
                self.call, self.body = CallStream(self.num_calls, self.names), ""
                continue
            keep = partial_tag_len(self.buffer)  # may be the start of a tag
            content += self.buffer[: len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep :]
            break
        return self._content(content), deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The rest at the end of the output: an unclosed call still counts if it is one
        (a model may stop right after it, or be cut short)."""
        rest, self.buffer = self.buffer, ""
        if self.call is not None:
            self.body += rest
            deltas = self.call.feed(rest)
            last = self._end_call()
            if last is not None:
                return self._content(""), deltas + last
            rest = self.before_call + OPEN + self.body
        content, self.held = self.held + rest, ""
        return content, []

    def _end_call(self) -> list[CallDelta] | None:
        last = self.call.finish(self.body)
        self.num_calls += last is not None
        self.call = None
        return last

    def _content(self, text: str) -> str:
        """Content to emit now: trailing whitespace is held until more content
        follows (or the output ends): if a call comes next, it is dropped."""
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body


class CallSequence:
    """Call objects one after another in `text` (fed whole each time, growing), from
    `pos`: a JSON object each (`separators` between them), or with `args_marker`,
    `name<marker>{arguments}` each (`MARKER`s between them). `failed` once a call
    does not parse; `sent`: a call went out."""

    def __init__(self, names: set[str], separators: str, args_marker: str | None = None) -> None:
        self.names = names
        self.separators = separators
        self.args_marker = args_marker
        self.text = ""
        self.pos = 0
        self.call: CallStream | None = None
        self.num_calls = 0
        self.failed = self.sent = self.closed = False

    def feed(self, text: str, final: bool) -> list[CallDelta]:
        self.text, deltas = text, []
        while not self.failed:
            if self.call is None and not self._next_call(final):
                break
            before = self.call.taken
            deltas += self.call.feed(self.text[self.pos :])
            self.pos += self.call.taken - before
            if not self.call.ended and not final:
                break
            last = self.call.finish()
            self.failed = last is None
            deltas += last or []
            self.num_calls += 1
            self.call = None
        self.sent = self.sent or bool(deltas)
        return deltas

    def _next_call(self, final: bool) -> bool:
        """Start the next call if its text has begun; False if it has not (or there is
        none: the text ended, or `closed` by a "]")."""
        rest = self.text[self.pos :]
        body = rest.lstrip(self.separators)
        if self.args_marker is not None:
            body = body.removeprefix(MistralParser.MARKER)
        if not body.strip() or body.startswith("]"):
            self.closed = body.startswith("]")
            return False
        name = None
        if self.args_marker is not None:
            name, sep, _ = body.partition(self.args_marker)
            if not sep:
                self.failed = final
                return False
            body = body[len(name) + len(sep) :]
        self.pos += len(rest) - len(body)
        self.call = CallStream(self.num_calls, self.names, name and name.strip())
        return True


class WholeOutputParser:
    """Formats whose calls are the whole output: decided by how it starts (`prefixes`),
    then read call by call; text that turns out not to be calls is content, if no call
    went out before."""

    prefixes: tuple[str, ...] = ()

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.buffer = ""
        self.mode = "start"  # "start" (undecided), "calls" or "content"

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
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
        return "", self.calls(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        deltas = self.calls(final=True) if self.mode == "calls" else []
        rest, self.buffer = self.buffer, ""
        if self.mode == "calls" and self.failed and not self.sent:
            return rest, []  # not calls after all
        return ("", deltas) if self.mode == "calls" else (rest, [])

    def calls(self, final: bool) -> list[CallDelta]:
        raise NotImplementedError


class Llama3JsonParser(WholeOutputParser):
    prefixes = ("<|python_tag|>", "{")

    def __init__(self, names: list[str]) -> None:
        super().__init__(names)
        self.sequence = CallSequence(self.names, " \t\r\n;")

    @property
    def failed(self) -> bool:
        return self.sequence.failed

    @property
    def sent(self) -> bool:
        return self.sequence.sent

    def calls(self, final: bool) -> list[CallDelta]:
        return self.sequence.feed(self.buffer.lstrip().removeprefix("<|python_tag|>"), final)


class PythonicParser(WholeOutputParser):
    """Calls as Python, read whole with `ast` once the list closes (their arguments are
    Python literals, turned into JSON)."""

    prefixes = ("<|python_start|>", "[")

    def __init__(self, names: list[str]) -> None:
        super().__init__(names)
        self.num_calls = 0
        self.failed = self.sent = False

    def calls(self, final: bool) -> list[CallDelta]:
        calls = self.parse(self.buffer, final)
        self.failed = calls is None and final
        new = (calls or [])[self.num_calls :]
        self.sent = self.sent or bool(new)
        self.num_calls += len(new)
        return [whole_call(self.num_calls - len(new) + k, c) for k, c in enumerate(new)]

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
    """Content until `[TOOL_CALLS]`; after it, the calls: a JSON array of call objects,
    or (newer) `name[ARGS]{...}`, each after its own `[TOOL_CALLS]`."""

    MARKER = "[TOOL_CALLS]"

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.buffer = ""
        self.in_calls = False  # the marker was read
        self.sequence: CallSequence | None = None  # once the calls' form is known
        self.array = False
        self.offset = 0  # where the sequence's text starts in the buffer

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.buffer += text
        if self.in_calls:
            return "", self._calls(final=False)
        start = self.buffer.find(self.MARKER)
        if start < 0:
            keep = partial_tag_len(self.buffer, self.MARKER)
            content, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]  # fmt: skip
            return content, []
        content, self.buffer = self.buffer[:start], self.buffer[start + len(self.MARKER) :]
        self.in_calls = True
        return content, self._calls(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        deltas = self._calls(final=True) if self.in_calls else []
        rest, self.buffer = self.buffer, ""
        if not self.in_calls:
            return rest, []
        seq = self.sequence
        failed = seq is None or seq.failed or (self.array and not seq.closed)
        if failed and not (seq is not None and seq.sent):
            return self.MARKER + rest, []  # not calls after all
        return "", deltas

    def _calls(self, final: bool) -> list[CallDelta]:
        if self.sequence is None:
            head = self.buffer.lstrip()
            if not head:
                return []
            self.array = head.startswith("[")
            self.offset = len(self.buffer) - len(head) + self.array
            separators = " \t\r\n," if self.array else " \t\r\n"
            self.sequence = CallSequence(self.names, separators, None if self.array else "[ARGS]")
        return self.sequence.feed(self.buffer[self.offset :], final)


_PARSERS = {
    "hermes": HermesParser,
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
