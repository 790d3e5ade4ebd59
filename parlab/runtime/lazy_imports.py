"""Defer one third-party import that costs every notebook kernel about 1.5 s of CPU (standard library only).

plotly's first `fig.show()` imports nbformat, nbformat imports jsonschema, and jsonschema's format checkers import
`rfc3987_syntax` when it is installed (JupyterLab's dependencies install it), which builds eight Earley parsers of
the IRI grammar at import (upstream: python-jsonschema/jsonschema#1428). No notebook, lesson or grader ever validates
an IRI, yet every kernel paid for the parsers before its first figure. `defer_rfc3987_syntax()` puts a stand-in
module in its place: jsonschema binds the stand-in's `is_valid_syntax`, and the real module is imported the first
time anything is asked of it, so a validation that does need it behaves as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

NAME = "rfc3987_syntax"


def _real_module() -> types.ModuleType:
    """Import the real module in place of the stand-in (once) and return it."""
    module = sys.modules.get(NAME)
    if module is None or getattr(module, "_parlab_stand_in", False):
        sys.modules.pop(NAME, None)
        module = importlib.import_module(NAME)
    return module


def defer_rfc3987_syntax() -> bool:
    """Stand in for `rfc3987_syntax` until it is used. True if the stand-in was put in place; False if the module is
    not installed or has been imported already (then nothing changes)."""
    if NAME in sys.modules:
        return False
    try:
        if importlib.util.find_spec(NAME) is None:
            return False
    except (ImportError, ValueError):
        return False
    stand_in = types.ModuleType(
        NAME, "stand-in for rfc3987_syntax, imported at first use (parlab.runtime.lazy_imports)"
    )
    stand_in._parlab_stand_in = True

    def is_valid_syntax(term: str, value: str) -> bool:
        return _real_module().is_valid_syntax(term, value)

    def __getattr__(name: str):
        if name.startswith("__"):  # the import system asks the stand-in for __path__ and the like: it has none
            raise AttributeError(name)
        return getattr(_real_module(), name)

    stand_in.is_valid_syntax = is_valid_syntax
    stand_in.__getattr__ = __getattr__
    sys.modules[NAME] = stand_in
    return True
