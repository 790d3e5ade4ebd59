"""The lab format: the markers of a lab notebook's cells, and the student version made from a solution.

    # ANSWER: name / # PREDICT: name       a student's cell (a prediction is an answer too)
    # CHECK: name (N points)               a graded check
    # BEGIN SOLUTION: hint ... # END SOLUTION   the solution's code; the handout gets the hint instead
    # HANDOUT                              inside a solution block: the (commented) code handed out instead

and how a verdict line is read: what it masks (`mask`, as tests/sanitize.cfg does) and which lines count.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import textwrap

ANSWER_RE = re.compile(r"^#\s*(?:ANSWER|PREDICT):\s*(?P<name>\S+)\s*$")  # a prediction is an answer too
PREDICT_RE = re.compile(r"^#\s*PREDICT:\s*(?P<name>\S+)\s*$")
CHECK_RE = re.compile(r"^#\s*CHECK:\s*(?P<name>\S+)\s*\((?P<points>\d+)\s*points?\)\s*$")
BEGIN_RE = re.compile(r"^(?P<indent>\s*)#\s*BEGIN SOLUTION(?::\s*(?P<hint>.*?))?\s*$")
END_RE = re.compile(r"^\s*#\s*END SOLUTION\s*$")
HANDOUT_RE = re.compile(r"^\s*#\s*HANDOUT\s*$")  # in a solution block: what follows (commented) is handed out
VERDICT_RE = re.compile(r": (PASS|FAIL)$")
HINT_WIDTH = 100  # the student version's hint lines stay within this many characters
NO_HINT = "write this"  # a stub's message when the solution block names no hint, or the handout is made without


# ----------------------------------------------------------------------------------------- reading the markers


def _first_line(cell) -> str:
    return cell.source.lstrip("\n").split("\n", 1)[0].strip() if cell.cell_type == "code" else ""


def answer_name(cell) -> str | None:
    """The name of an ANSWER cell (from its first line, else from its metadata), or None."""
    match = ANSWER_RE.match(_first_line(cell))
    if match:
        return match["name"]
    return cell.get("metadata", {}).get("parlab", {}).get("answer") if cell.cell_type == "code" else None


def prediction_name(cell) -> str | None:
    """The name of a PREDICT cell (a prediction is scored by the check of the same name), or None."""
    match = PREDICT_RE.match(_first_line(cell))
    return match["name"] if match else None


def check_marker(cell) -> tuple[str, int] | None:
    """(name, points) of a CHECK cell, or None."""
    match = CHECK_RE.match(_first_line(cell))
    return (match["name"], int(match["points"])) if match else None


# ------------------------------------------------------------------------------------- the student version


def strip_solution(source: str, hints: bool = True) -> str:
    """Replace every `# BEGIN SOLUTION: hint` ... `# END SOLUTION` block by `raise NotImplementedError("hint")`
    (with hints=False, `raise NotImplementedError("write this")`: no hint in the stub either).

    A block with a `# HANDOUT` line (the bug hunt) is replaced by what follows that line instead, uncommented: the
    solution keeps the broken code as comments, the student gets it as code, under a line naming the hint."""
    out, inside, handout = [], False, None
    for number, line in enumerate(source.split("\n"), start=1):
        begin, end = BEGIN_RE.match(line), END_RE.match(line)
        if begin:
            if inside:
                raise ValueError(f"line {number}: BEGIN SOLUTION inside another solution block")
            inside, handout = True, None
            indent, hint = begin["indent"], begin["hint"] or ""
        elif inside and HANDOUT_RE.match(line):
            if handout is not None:
                raise ValueError(f"line {number}: two HANDOUT lines in one solution block")
            handout = []
        elif end:
            if not inside:
                raise ValueError(f"line {number}: END SOLUTION without BEGIN SOLUTION")
            inside = False
            out.extend(_handed_out(indent, hint if hints else "", handout))
        elif inside and handout is not None:
            handout.append(line)
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("BEGIN SOLUTION without END SOLUTION")
    return "\n".join(out)


def _handed_out(indent: str, hint: str, handout: list[str] | None) -> list[str]:
    """What a solution block becomes in the student version."""
    if handout is not None:  # the broken code, uncommented, under the hint as a comment
        width = HINT_WIDTH - len(indent) - 2
        lines = [f"{indent}# {piece}" for piece in textwrap.wrap(hint, width)] if hint else []
        for line in handout:
            body = line[len(indent) :] if line.startswith(indent) else line.lstrip()
            if not body.startswith("#"):
                raise ValueError(f"a HANDOUT line must be commented out in the solution: {line.strip()!r}")
            lines.append(indent + body[2:] if body.startswith("# ") else indent + body[1:])
        return lines
    hint = hint or NO_HINT
    lines = [f"{indent}# YOUR CODE HERE"]
    if len(indent) + len(hint) <= HINT_WIDTH - 30:
        lines.append(f"{indent}raise NotImplementedError({json.dumps(hint)})")
    else:  # a long hint: one string in pieces, one per line, short enough for a projector
        pieces = textwrap.wrap(hint, HINT_WIDTH - len(indent) - 6, drop_whitespace=False)
        lines.append(f"{indent}raise NotImplementedError(")
        lines.extend(f"{indent}    {json.dumps(piece)}" for piece in pieces)
        lines.append(f"{indent})")
    return lines


def hint_of(cell) -> str | None:
    """The check a hint cell explains (a markdown cell with metadata parlab.hint), or None."""
    meta = cell.get("metadata", {}).get("parlab", {})
    hint = meta.get("hint") if isinstance(meta, dict) and cell.cell_type == "markdown" else None
    return hint if isinstance(hint, str) else None


def solution_only(cell) -> bool:
    """A markdown cell for the solution alone (cell tag "solution-only"): a lab's closing "What you built" says in
    words what each part needed, which a handout must not say before the student has found it."""
    return cell.cell_type == "markdown" and "solution-only" in cell.get("metadata", {}).get("tags", [])


def student_version(solution, hints: bool = True):
    """The notebook handed to students: solution blocks stripped, solution-only cells left out, and no stored output
    (no verdict shows before the student's own run; the expected verdicts stay in the solution, where the grader
    reads them). With `hints=False` the hint cells (markdown cells with metadata parlab.hint) are left out too, and
    every stub says only "write this"."""
    nb = copy.deepcopy(solution)
    nb.cells = [cell for cell in nb.cells if not solution_only(cell)]
    if not hints:
        nb.cells = [cell for cell in nb.cells if hint_of(cell) is None]
    answers = set()
    for index, cell in enumerate(nb.cells):
        has_solution = cell.cell_type == "code" and "BEGIN SOLUTION" in cell.source
        name = answer_name(cell)
        if has_solution and name is None:
            raise ValueError(f"cell {index} has a solution block but is not an '# ANSWER: name' cell")
        if name is not None:
            if not has_solution:
                raise ValueError(f"answer cell {name!r} has no BEGIN SOLUTION block")
            if name in answers:
                raise ValueError(f"two answer cells are named {name!r}")
            answers.add(name)
            cell.source = strip_solution(cell.source, hints)
        cell.metadata.pop("execution", None)  # timestamps: the generated file must not change from run to run
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    if not answers:
        raise ValueError("the notebook has no '# ANSWER: name' cell")
    if not any(check_marker(c) for c in nb.cells):
        raise ValueError("the notebook has no '# CHECK: name (N points)' cell")
    return nb


# The masks of tests/sanitize.cfg (tests/test_labs.py checks that they agree).
MASKS = [
    (re.compile(r"max \|err\| [0-9.]+e[-+][0-9]+"), "max |err| ERR"),
    (re.compile(r"at 0x[0-9a-f]+"), "at 0xADDRESS"),
]


def mask(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


def verdict_lines(outputs) -> list[str]:
    """The masked verdict lines (ending in ': PASS' or ': FAIL') a cell printed to stdout."""
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return [mask(line.rstrip()) for line in text.splitlines() if VERDICT_RE.search(line.rstrip())]


# ------------------------------------------------------------------------------------------- a prediction's cell

# A prediction is the student's own number. The lab's checks module computes every prediction's theory (THEORY),
# and a student can reach it: a PREDICT cell may compute (loops, its own functions, the lab's data and model) but may
# not import anything but math, nor touch the checks module but for its data tables (checks.UPPER_CASE, THEORY and
# the other answer keys excepted), nor reach around these rules (eval, getattr, dunder names, ...).
ANSWER_KEYS = {"THEORY", "STRUCTURAL", "LIBRARY"}
FORBIDDEN_NAMES = {
    "eval", "exec", "compile", "getattr", "setattr", "delattr", "globals", "locals", "vars", "open", "importlib",
    "sys", "builtins", "THEORY",
}  # fmt: skip


def prediction_problem(source: str) -> str:
    """Why a PREDICT cell is not the student's own computation ('' when it is): see ANSWER_KEYS and
    FORBIDDEN_NAMES above."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return f"the prediction cell does not parse ({exc.msg})"
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        if isinstance(node, ast.ImportFrom) or (
            isinstance(node, ast.Import) and [a.name for a in node.names] != ["math"]
        ):
            return f"a prediction imports nothing but math (line {line})"
        if isinstance(node, ast.Attribute):
            if node.attr.startswith("_"):
                return f"a prediction uses no private or dunder attribute: .{node.attr} (line {line})"
            if isinstance(node.value, ast.Name) and node.value.id == "checks":
                if not node.attr.isupper() or node.attr in ANSWER_KEYS:
                    return f"a prediction reads only the checks' data tables, not checks.{node.attr} (line {line})"
        if isinstance(node, ast.Name) and (node.id.startswith("__") or node.id in FORBIDDEN_NAMES):
            return f"a prediction uses no {node.id} (line {line})"
    return ""
