"""Incremental detokenization and stop strings, one instance per request.

Text is decoded over a small sliding window of ids (vLLM's prefix/read
offsets), so each step costs O(1) and a multi-byte UTF-8 character split
across tokens is held back until it is whole.
"""

from __future__ import annotations

# Ids decoded before the read offset give the window's context (a leading
# space or a partial character depends on its neighbours).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def add_tokens(self, new_token_ids: list[int], last: bool = False) -> str | None:
        """Append tokens; returns the stop string that matched, if any (the text is cut there).

        `last` flushes text held back for an incomplete character: nothing follows.
        """
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(
            self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens
        )
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not last):
            return None  # an incomplete character: wait for the next token
        new_text = full[len(prefix) :]
        old_len = len(self.output_text)
        self.output_text += new_text
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return self._check_stop(old_len) if self.stop else None

    def visible_text(self, finished: bool) -> str:
        """The text safe to show: while running, the tail that could still turn
        out to begin a stop string is held back (it may yet be cut)."""
        if finished or not self.stop:
            return self.output_text
        hold = max(len(s) for s in self.stop) - 1
        return self.output_text[: len(self.output_text) - hold] if hold else self.output_text

    def _check_stop(self, old_len: int) -> str | None:
        text = self.output_text
        for stop in self.stop:
            # Only where the new text could complete a match.
            idx = text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1:
                self.output_text = text[: idx + len(stop)] if self.include_stop else text[:idx]
                return stop
        return None
