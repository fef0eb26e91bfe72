"""Incremental detokenization and stop strings, one instance per completion.

Text is decoded over a small sliding window of ids (vLLM's prefix/read
offsets), so each step costs O(1) whatever the output's length, and a
multi-byte UTF-8 character split across tokens is held back until it is whole.

Stop strings: the last `max(len(stop)) - 1` characters are held back too,
since they may still turn out to begin a stop string; a match is searched
only in the held-back text plus the new text, where it can end.

    released text | pending (held back) | new text
                  |<-------- searched for a stop string ------->|
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
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # the window
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.pending = ""  # decoded, not yet released
        self.stopped = False

    def add_tokens(self, new_token_ids: list[int], last: bool = False) -> tuple[str, str | None]:
        """Decode the new tokens. Returns (text released now, the stop string that
        matched or None); after a match the text ends there and nothing more comes.
        `last` releases what is held back: nothing follows."""
        if self.stopped:
            return "", None
        self.token_ids.extend(new_token_ids)
        text = self.pending + self._decode_new(last)
        self.pending = ""
        if self.stop:
            match = min(((i, s) for s in self.stop if (i := text.find(s)) != -1), default=None)
            if match is not None:
                i, stop = match
                self.stopped = True
                return text[: i + len(stop)] if self.include_stop else text[:i], stop
        if not last and self.hold:
            text, self.pending = text[: -self.hold], text[-self.hold :]
        return text, None

    def flush(self) -> str:
        """What is still held back, when the completion ends for another reason."""
        text, self.pending = self.pending, ""
        return text

    def _decode_new(self, last: bool) -> str:
        decode = self.tokenizer.decode
        window = self.token_ids[self.prefix_offset :]
        prefix = decode(
            window[: self.read_offset - self.prefix_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(window, skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not last):
            return ""  # nothing new, or an incomplete character: wait for the next token
        # The next window starts at the old read offset; ids before it are never decoded again.
        del self.token_ids[: self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)
        return full[len(prefix) :]
