"""Reasoning output: the `<think>...</think>` block reasoning models (Qwen3, DeepSeek-R1
and its distills) write before their answer, split from the answer.

`--reasoning-parser deepseek_r1|qwen3` (vLLM's flag and names; both models use the
same tags, so both names run the one parser here). Where the block starts is read
off the prompt: a chat template that opens it (DeepSeek-R1's, Qwen3's thinking
templates) ends the prompt with `<think>`, so the output begins inside it; one that
turned thinking off (Qwen3 with `enable_thinking: false`) ends it with an empty,
closed block, so the output is all answer; otherwise the output may open one itself.

Structured outputs and forced tool calls constrain only the answer: a request's
grammar starts after the output's `</think>` (`SamplingParams.grammar_after`),
unless the prompt already closed the block.
"""

from __future__ import annotations

from pagoda.engine.tools import partial_tag_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_state(prompt: str | None) -> str:
    """ "open" (the prompt opened the block), "closed" (it closed one: no reasoning
    follows) or "start" (the output may open one)."""
    tail = (prompt or "").rstrip()
    if tail.endswith(THINK_OPEN):
        return "open"
    if tail.endswith(THINK_CLOSE):
        return "closed"
    return "start"


class ReasoningParser:
    """Splits one output's text into (reasoning, answer) as it streams in; `feed` and
    `finish` return the new pieces of each. Whole responses feed all the text at
    once, so streamed and whole responses are the same split. The tags themselves,
    and the newlines right after `</think>`, belong to neither."""

    def __init__(self, prompt: str | None) -> None:
        state = prompt_state(prompt)
        self.state = {"open": "reasoning", "closed": "answer", "start": "start"}[state]
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = answer = ""
        while True:
            if self.state == "start":  # does the output open a block?
                head = self.buffer.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buffer, self.state = head[len(THINK_OPEN) :], "reasoning"
                elif THINK_OPEN.startswith(head):
                    break  # too little text yet to tell
                else:
                    self.state = "answer"
            elif self.state == "reasoning":
                end = self.buffer.find(THINK_CLOSE)
                if end < 0:
                    keep = partial_tag_len(self.buffer, THINK_CLOSE)
                    reasoning += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                reasoning += self.buffer[:end]
                self.buffer, self.state = self.buffer[end + len(THINK_CLOSE) :], "after"
            elif self.state == "after":  # newlines between the block and the answer
                self.buffer = self.buffer.lstrip("\n")
                if not self.buffer:
                    break
                self.state = "answer"
            else:
                answer, self.buffer = answer + self.buffer, ""
                break
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is held at the end: an unclosed block's tail is reasoning; text that
        might have opened a block but did not is answer."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest if self.state in ("start", "answer") else ""
