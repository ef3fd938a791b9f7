"""A calculator tool: arithmetic on numbers, evaluated from the expression's syntax tree (never `eval`).

Accepted: integers, decimals, `+ - * / // % **`, unary `+ -`, parentheses, the constants `pi`, `e`, and the
functions `sqrt`, `abs`, `round`, `min`, `max`, `floor`, `ceil`, `log` (natural, or to a base), `exp`,
`sin`, `cos`, `tan`. Anything else (names, attributes, calls of other functions, strings, comprehensions)
is refused with a message naming it. Exponents and intermediate integers are bounded so that no
expression can take more than a moment.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 10_000
MAX_INT_BITS = 4096

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
}

PARAMETERS = {
    "type": "object",
    "properties": {
        "expression": {"type": "string", "description": "An arithmetic expression, e.g. (3 + 4.5) * 2 ** 3"}
    },
    "required": ["expression"],
    "additionalProperties": False,
}
DESCRIPTION = (
    "Evaluates an arithmetic expression exactly (integers stay exact) and returns its value. Supports "
    "+ - * / // % **, parentheses, pi, e, sqrt, abs, round, min, max, floor, ceil, log, exp, sin, cos, tan."
)


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is for the model."""


def evaluate(expression: str) -> int | float:
    """The value of `expression`; raises CalculatorError naming what is wrong."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an arithmetic expression: {err.msg}") from None
    try:
        return _eval(tree.body)
    except (ArithmeticError, ValueError, TypeError, RecursionError) as err:
        if isinstance(err, CalculatorError):
            raise
        raise CalculatorError(f"{type(err).__name__}: {err}") from None


def _number(value: Any) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"an intermediate integer exceeds {MAX_INT_BITS} bits")
    return value


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
            if left.bit_length() * right > MAX_INT_BITS:
                raise CalculatorError(f"an intermediate integer exceeds {MAX_INT_BITS} bits")
        return _number(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise CalculatorError(f"{node.func.id}() takes no keyword arguments")
        return _number(_FUNCTIONS[node.func.id](*[_eval(arg) for arg in node.args]))
    if isinstance(node, ast.Name):
        raise CalculatorError(f"unknown name {node.id!r}")
    if isinstance(node, ast.Call):
        raise CalculatorError(f"unknown function {ast.unparse(node.func)!r}")
    raise CalculatorError(f"{type(node).__name__} is not arithmetic: {ast.unparse(node)!r:.80}")


def calculator(expression: str) -> str:
    """The tool: the value of `expression` as text (`repr` of an int or float)."""
    return repr(evaluate(expression))
