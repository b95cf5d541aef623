"""A user's code read without running it: the syntax tree of a function or class, and the
names it mentions. What cannot be read (code made at run time, a lambda in a notebook
whose source is gone) reads as None and mentions nothing: callers decide by default."""

from __future__ import annotations

import ast
import inspect
import textwrap


def tree(obj) -> ast.AST | None:
    """The syntax tree of `obj`'s source (a function, method or class), or None."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None


def mentions(obj, names) -> set[str]:
    """Which of `names` `obj`'s source mentions: as a variable, an attribute
    (`strategy.num_replicas_in_sync`) or a called function (`tf.nn.compute_average_loss`)."""
    parsed = tree(obj)
    if parsed is None:
        return set()
    wanted = set(names)
    found = set()
    for node in ast.walk(parsed):
        if isinstance(node, ast.Name) and node.id in wanted:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in wanted:
            found.add(node.attr)
    return found
