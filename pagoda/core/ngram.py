"""Prompt lookup (n-gram) drafts for speculative decoding. Integers only.

The draft for a sequence is what followed the most recent earlier occurrence of
its last n tokens, trying the longest n first:

    tokens   ... a b c d e ... x y a b c
                 |---| proposed: d e       (n = 3, k = 2)

Text that an answer repeats from its prompt (summaries, code edits,
extraction) is where this pays. The search is bytes.rfind over the ids packed
as 32-bit integers: C speed, no per-token Python.
"""

from __future__ import annotations

from array import array

_ITEM = 4  # bytes per packed id


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` draft tokens for the sequence `token_ids`, or [] without a match."""
    if k < 1 or len(token_ids) <= n_min:
        return []
    haystack = array("i", token_ids).tobytes()
    length = len(haystack)
    for n in range(min(n_max, len(token_ids) - 1), n_min - 1, -1):
        pattern = haystack[length - n * _ITEM :]
        # An occurrence ending before the last id: not the suffix itself.
        end = length - _ITEM
        while (found := haystack.rfind(pattern, 0, end)) != -1:
            if found % _ITEM == 0:  # aligned on an id, not across two
                start = found // _ITEM + n
                return token_ids[start : start + k]
            end = found + len(pattern) - 1
    return []
