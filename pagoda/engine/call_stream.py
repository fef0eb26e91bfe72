"""Tool calls as they stream: each call goes out in pieces (`CallDelta`), its id and
name first, then its arguments' JSON text as the model writes it.

A call object (`{"name": ..., "arguments": {...}}`, Llama's `"parameters"` too) is
read by `ObjectScanner`, which finds its top-level values as the text arrives.
Once the name is read (and is one of the tools') and the arguments object has
begun, the object is a call (`CallStream`): its arguments stream from then on, and
are the model's own text, so the pieces add up to the whole response's arguments
exactly. (A call cut short, by max_tokens say, keeps what was written, as OpenAI's
do.) An object that never gets that far (a name after a string of arguments, say)
is judged whole when it ends, by json.loads: a call, or text after all.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from pagoda.engine.tools import ParsedCall, parsed_call

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallDelta:
    """A piece of an output's `index`-th call: its id and name on the first piece, then
    the next text of its arguments; `done` on the last."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    done: bool = False


def merge_calls(deltas: Iterable[CallDelta]) -> list[ParsedCall]:
    """The whole calls that `deltas` add up to, in order."""
    calls: dict[int, ParsedCall] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = ParsedCall(d.id, d.name, "")
        calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def whole_call(index: int, call: ParsedCall) -> CallDelta:
    return CallDelta(index, call.id, call.name, call.arguments, done=True)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ObjectScanner:
    """One JSON object's text as it streams in: where each top-level value starts and
    ends (keys read as they close) and where the object ends. It does not validate
    (json.loads judges what must be whole); text before the `{` other than whitespace
    makes it `invalid`."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = self.escape = False
        self.key_start = 0
        self.key: str | None = None
        # "open" (before the brace), "key", "colon", "value", then the value's kind:
        # "string", "nested" (an object or array) or "scalar", then "after" it.
        self.state = "open"
        self.values: dict[str, list] = {}  # key -> [start, end (None while open)]
        self.end: int | None = None  # just past the closing brace
        self.invalid = False

    def feed(self, text: str) -> int:
        """Read `text` up to the object's end; returns how much of it was taken."""
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            if self.end is not None:
                break
            self._char(i, self.text[i])
        if self.end is not None:
            self.text = self.text[: self.end]
        return len(self.text) - start

    def _char(self, i: int, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1 and self.state == "key":
                    self.key, self.state = self._key(self.text[self.key_start : i + 1]), "colon"
                elif self.depth == 1 and self.state == "string":
                    self._close(i + 1)
            return
        if self.state == "open":
            if c == "{":
                self.depth, self.state = 1, "key"
            elif not c.isspace():
                self.invalid, self.end = True, i
            return
        if c == '"':
            self.in_string = True
            if self.depth == 1 and self.state == "key":
                self.key_start = i
            elif self.depth == 1 and self.state == "value":
                self._open(i, "string")
        elif c in "{[":
            self.depth += 1
            if self.depth == 2 and self.state == "value":
                self._open(i, "nested")
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.state == "nested":
                self._close(i + 1)
            elif self.depth == 0:
                if self.state == "scalar":
                    self._close(i)
                self.end = i + 1
        elif self.depth != 1:
            return
        elif c == ":" and self.state == "colon":
            self.state = "value"
        elif c == "," and self.state in ("after", "scalar"):
            if self.state == "scalar":
                self._close(i)
            self.state = "key"
        elif self.state == "value" and not c.isspace():
            self._open(i, "scalar")

    @staticmethod
    def _key(text: str) -> str | None:
        try:
            return json.loads(text)
        except ValueError:
            return None

    def _open(self, i: int, kind: str) -> None:
        self.values[self.key] = [i, None]
        self.state = kind

    def _close(self, end: int) -> None:
        self.values[self.key][1] = end
        self.state = "after"

    def value(self, key: str) -> str | None:
        """The text of a value read whole, else None."""
        span = self.values.get(key)
        return None if span is None or span[1] is None else self.text[span[0] : span[1]]


class CallStream:
    """The `index`-th call object of an output as it streams (see the module's docstring).
    With `name` (Mistral's `name[ARGS]{...}`), the object read is the arguments."""

    def __init__(self, index: int, names: set[str], name: str | None = None) -> None:
        self.index = index
        self.names = names
        self.name = name
        self.scanner = ObjectScanner()
        self.args: tuple[int, str | None] | None = None  # (where the arguments start, key)
        self.num_sent = 0  # of the arguments' characters
        self.taken = 0  # characters fed that the object took

    @property
    def ended(self) -> bool:
        return self.scanner.end is not None

    def feed(self, text: str) -> list[CallDelta]:
        """The call's new pieces from `text`; `taken` grows by what the object took
        (the rest follows it)."""
        self.taken += self.scanner.feed(text)
        out = []
        if self.args is None:
            head = self._head()
            if head is None:
                return []
            out.append(head)
        piece = self._arguments()
        if piece:
            out.append(CallDelta(self.index, arguments=piece))
        return out

    def finish(self, text: str | None = None) -> list[CallDelta] | None:
        """The call's last pieces when its text has ended; None if it never was a call
        (judged on `text`, all the call's text, where more came after the object)."""
        if self.args is None:
            text = self.scanner.text if text is None else text
            obj = {"name": self.name, "arguments": text} if self.name is not None else text
            try:
                call = parsed_call(obj if self.name is not None else json.loads(obj), self.names)
            except json.JSONDecodeError:
                call = None
            return None if call is None else [whole_call(self.index, call)]
        return [CallDelta(self.index, arguments=self._arguments(), done=True)]

    def _head(self) -> CallDelta | None:
        s = self.scanner
        if self.name is not None:  # the object is the arguments
            if s.state == "open" or self.name not in self.names:
                return None
            self.args = (s.text.index("{"), None)
            return CallDelta(self.index, new_call_id(), self.name)
        key = next((k for k in ARGUMENT_KEYS if k in s.values), None)
        name = s.value("name")
        if key is None or name is None or s.text[s.values[key][0]] != "{":
            return None  # an object of arguments (not one's JSON text) streams
        name = ObjectScanner._key(name)
        if name not in self.names:
            return None
        self.args = (s.values[key][0], key)
        return CallDelta(self.index, new_call_id(), name)

    def _arguments(self) -> str:
        """The arguments' text not sent yet, up to their end or the text's."""
        s, (start, key) = self.scanner, self.args
        end = (s.end if key is None else s.values[key][1]) or len(s.text)
        piece = s.text[start + self.num_sent : end]
        self.num_sent += len(piece)
        return piece
