"""A calculator tool: exact arithmetic on what the model wrote, by parsing, never evaluating.

The expression is parsed with Python's own parser (`ast.parse`, which builds a tree and runs
nothing) and the tree is walked here, accepting only numbers, + - * / // % ** and parentheses;
any other node (a name, a call, an attribute, a string) is refused. Numbers are exact fractions,
so 0.1 + 0.2 is 3/10 and 1/3 * 3 is 1. Sizes are bounded before the work: the text's length,
the tree's depth, an exponent's size and every intermediate result's digits, so that
`9**9**9` is refused rather than computed.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_CHARS = 200
MAX_DEPTH = 32
MAX_EXPONENT = 1000
MAX_DIGITS = 1000


class CalculatorError(ValueError):
    """An expression the calculator will not compute; the message goes back to the model."""


def _digits(x: Fraction) -> int:
    return max(len(str(abs(x.numerator))), len(str(x.denominator)))


def _check(x: Fraction) -> Fraction:
    if _digits(x) > MAX_DIGITS:
        raise CalculatorError(f"a result has more than {MAX_DIGITS} digits")
    return x


def _eval(node: ast.AST, depth: int = 0) -> Fraction:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"nested more than {MAX_DEPTH} deep")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float):
            if node.value != node.value or node.value in (float("inf"), float("-inf")):
                raise CalculatorError("a number too large to write exactly")
            return _check(Fraction(str(node.value)))
        return _check(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand, depth + 1)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        op = node.op
        if isinstance(op, ast.Add):
            return _check(a + b)
        if isinstance(op, ast.Sub):
            return _check(a - b)
        if isinstance(op, ast.Mult):
            return _check(a * b)
        if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)):
            if b == 0:
                raise CalculatorError("division by zero")
            if isinstance(op, ast.Div):
                return _check(a / b)
            return _check(Fraction(a // b) if isinstance(op, ast.FloorDiv) else a % b)
        if isinstance(op, ast.Pow):
            if b.denominator != 1:
                raise CalculatorError("only whole-number exponents (the result would not be exact)")
            if abs(b) > MAX_EXPONENT:
                raise CalculatorError(f"an exponent above {MAX_EXPONENT}")
            if a == 0 and b < 0:
                raise CalculatorError("division by zero")
            if _digits(a) * abs(b.numerator) > MAX_DIGITS * 2:
                raise CalculatorError(f"a result has more than {MAX_DIGITS} digits")
            return _check(a**b.numerator)
    what = type(node).__name__
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        what = type(node.op).__name__
    raise CalculatorError(f"not arithmetic: {what} (numbers, + - * / // % ** and parentheses)")


def format_number(x: Fraction) -> str:
    """An exact result as text: an integer, or a fraction `p/q` with its decimal beside it when
    the decimal ends within 12 places."""
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:  # a finite decimal
        places = 0
        while (x * 10**places).denominator != 1:
            places += 1
        if places <= 12:
            return f"{x.numerator}/{x.denominator} = {float(x):.{places}f}"
    return f"{x.numerator}/{x.denominator}"


def calculator(expression: str) -> str:
    """Compute an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 3 / 4".

    Returns:
        The exact result: an integer, or a fraction with its decimal when it has one.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be text, got {type(expression).__name__}")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("an empty expression")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"an expression over {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"cannot parse {text!r}: {e.msg if hasattr(e, 'msg') else e}") from e
    return format_number(_eval(tree.body))
