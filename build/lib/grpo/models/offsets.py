"""Where each sampled token ends in its completion's decoded text (for process rewards, which
score text spans: their steps end at characters, the advantage needs tokens).

The tokenizer's own offsets are used when the sampled tokens are the canonical encoding of
their text (the usual case); otherwise, as when a model spells "13" as "1" "3" where BPE would
merge them, the ends come from decoding each prefix. A character whose bytes are split over
several tokens (byte-level BPE) is complete only at the last of them.
"""

from __future__ import annotations

from typing import Any


def token_char_ends(tok: Any, ids: list[int]) -> list[int]:
    """For each token of a completion, how many characters of its decoded text
    (special tokens skipped) are complete once that token is read; non-decreasing."""
    special = set(tok.all_special_ids)
    text = tok.decode(ids, skip_special_tokens=True)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    content = [i for i in ids if i not in special]
    if enc["input_ids"] == content:
        spans = enc["offset_mapping"]
        ends = []
        for j, (start, end) in enumerate(spans):
            # byte-level BPE gives every piece of a split character the character's span
            split = j + 1 < len(spans) and spans[j + 1][0] < end
            ends.append(start if split else end)
        it, last, out = iter(ends), 0, []
        for i in ids:
            if i not in special:
                last = max(last, next(it))
            out.append(last)
        return out
    prefixes = tok.batch_decode([ids[: t + 1] for t in range(len(ids))], skip_special_tokens=True)
    return [_common_prefix(p, text) for p in prefixes]


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix: a partial character decodes as U+FFFD and stops it."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def char_to_token(char_ends: list[int], char: int) -> int:
    """The token at which character `char` is complete (the last token if never).

    >>> char_to_token([2, 2, 5, 6], 3)
    2
    """
    return next((t for t, e in enumerate(char_ends) if e > char), len(char_ends) - 1)
