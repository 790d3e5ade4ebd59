"""parlab defers `rfc3987_syntax` (imported by jsonschema through nbformat, through plotly's first figure) to its first
use: nothing changes in what jsonschema validates, and a kernel that never validates an IRI never builds its parsers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("rfc3987_syntax") is None, reason="rfc3987_syntax is not installed here"
)

VALIDATE = """
import json, sys
from jsonschema import FormatChecker
checker = FormatChecker()
cases = [("http://example.com/\\u00e4", "iri"), ("not an iri ::", "iri"), ("a b", "iri-reference"),
         ("../relative?q#f", "iri-reference"), ("", "iri")]
print(json.dumps([checker.conforms(value, format) for value, format in cases]))
"""

PROBE = """
import json, sys
import parlab  # as a lesson's first cell does
import plotly.io._renderers  # what a first fig.show() imports: nbformat, jsonschema
stand_in = getattr(sys.modules.get("rfc3987_syntax"), "_parlab_stand_in", False)
parsers_built = "rfc3987_syntax.syntax_helpers" in sys.modules
print(json.dumps([stand_in, parsers_built]))
"""


def _run(code: str) -> list:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_parlab_then_plotlys_renderers_builds_no_iri_parser():
    assert _run(PROBE) == [True, False]


def test_jsonschema_validates_iris_exactly_as_without_parlab():
    without = _run(VALIDATE)
    with_parlab = _run("import parlab\n" + VALIDATE)
    assert with_parlab == without and without.count(True) >= 2 and without.count(False) >= 2, (with_parlab, without)


def test_the_stand_in_hands_over_to_the_real_module_at_first_use():
    code = """
import json, sys
import parlab, jsonschema
import rfc3987_syntax
before = getattr(sys.modules["rfc3987_syntax"], "_parlab_stand_in", False)
ok = rfc3987_syntax.is_valid_syntax("iri", "https://example.org/a")
after = getattr(sys.modules["rfc3987_syntax"], "_parlab_stand_in", False)
print(json.dumps([before, ok, after, callable(rfc3987_syntax.parse)]))
"""
    assert _run(code) == [True, True, False, True]
