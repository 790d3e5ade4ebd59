"""Each lesson's demos and figures (one module per lesson, named after its scheme), the slideshow metadata
(slides.py) and the figure export (figures.py, `python -m parlab figures`). The schemes themselves are in
parlab/schemes; a lesson module runs and draws them.
"""

import ast
import inspect
import textwrap


def code(obj, *, docstring: bool = True) -> str:
    """The source of a function, method or class as a lesson prints it. docstring=False leaves out the docstring
    of `obj` itself (a slide shows the code; the lesson's text around it says what the docstring says)."""
    source = inspect.getsource(obj)
    if docstring:
        return source
    body = ast.parse(textwrap.dedent(source)).body[0]
    first = body.body[0] if getattr(body, "body", None) else None
    if not (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    ):
        return source
    lines = source.splitlines(keepends=True)
    return "".join(lines[: first.lineno - 1] + lines[first.end_lineno :])
