"""The out-of-format check: reasoning-gym held-out problems asked in other words.

A model trained on one generator's template can learn the template rather than the skill and
lose much of its accuracy when the same problem is phrased otherwise. `rg:reworded:<name>`
(and `rg:reworded:mix`) is the held-out set `rg:<name>` with each question rewritten here,
the same numbers, words and answer, scored by the generator's own checker; its rows keep
their ids, so a model's answers in both phrasings pair up problem by problem.

Each rewording parses the generator's question with a pattern and writes it in a template of
our own; a question the pattern does not match is an error naming the generator, never passed
through unchanged (which would measure the original format again).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from grpo.data.files import DataError


def _chain_sum(m: re.Match[str]) -> str:
    return f"Work out {m['expr']} and say what number it comes to."


def _leg_counting(m: re.Match[str]) -> str:
    return f"A farm has {m['animals']}. Counting every leg of every animal, how many legs is that?"


def _letter_counting(m: re.Match[str]) -> str:
    return (
        f'Look at the words "{m["text"]}". Count the {m["letter"]}\'s in them: how many are there?'
    )


def _count_bits(m: re.Match[str]) -> str:
    return f"Write {m['n']} in base 2. How many of its digits are ones?"


def _gcd(m: re.Match[str]) -> str:
    return f"Which is the biggest whole number that divides {_and(m['nums'])} with no remainder?"


def _products(m: re.Match[str]) -> str:
    return f"Multiply {m['a']} by {m['b']}. What is the product?"


def _lcm(m: re.Match[str]) -> str:
    both = "both" if m["nums"].count(",") == 1 else "all"
    return f"Which is the smallest positive number that {_and(m['nums'])} {both} divide exactly?"


def _and(nums: str) -> str:
    parts = [p.strip() for p in nums.split(",")]
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


# generator -> (the pattern of its question, our phrasing of the match)
REWORDINGS: dict[str, tuple[re.Pattern[str], Callable[[re.Match[str]], str]]] = {
    "chain_sum": (re.compile(
        r"State the final answer to the following arithmetic problem: (?P<expr>.+?) =\s*"),
        _chain_sum),
    "leg_counting": (re.compile(
        r".*how many legs are there in total if you have (?P<animals>.+?)\?\s*", re.S),
        _leg_counting),
    "letter_counting": (re.compile(
        r'How many times does the letter "(?P<letter>.)" appear in the text: "(?P<text>.+)"\?'),
        _letter_counting),
    "count_bits": (re.compile(
        r"How many 1 bits are there in the binary representation of the number (?P<n>\d+)\?"),
        _count_bits),
    "gcd": (re.compile(
        r"Find the Greatest Common Divisor \(GCD\) of these numbers: (?P<nums>[\d, ]+)\..*", re.S),
        _gcd),
    "products": (re.compile(
        r"Solve the following multiplication: (?P<a>\d+) \* (?P<b>\d+)\..*", re.S), _products),
    "lcm": (re.compile(
        r"Find the Least Common Multiple \(LCM\) of these numbers: (?P<nums>[\d, ]+)\s*"), _lcm),
}  # fmt: skip


def reword(generator: str, question: str) -> str:
    """`question` of `generator` in other words (same numbers, same answer).

    Args:
        generator: the reasoning-gym generator that wrote it.
        question: its question text.
    """
    if generator not in REWORDINGS:
        raise DataError(
            f"rg:reworded: no rewording for generator {generator!r}; reworded sets exist for "
            f"{', '.join(sorted(REWORDINGS))} (grpo/data/rewording.py)"
        )
    pattern, write = REWORDINGS[generator]
    m = pattern.fullmatch(question)
    if m is None:
        raise DataError(
            f"rg:reworded:{generator}: a question does not have the form its rewording parses "
            f"(another reasoning-gym version or config?): {question[:80]!r}"
        )
    return write(m)
