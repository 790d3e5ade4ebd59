"""Every lesson executes headless, the way `jupyter nbconvert --to notebook --execute` does, without stalling.

nbclient (behind nbconvert, papermill, `jupyter execute`) could wait a whole cell timeout after an `interact` cell
although the kernel had long replied (jupyter/nbclient#312): see parlab/views/widgets.py for why, and for the `interact`
the lessons use instead. Here each lesson runs in a fresh kernel; its wall time must stay within 1.5x the sum of its
cells' execution times (from the kernel's own timestamps in each cell's execution metadata) plus 10 s.

Each lesson is executed once in the suite: nbval re-executes every lesson (and compares its outputs), so here only
lesson 00 runs headless end to end (its sliders are the interact cells that once stalled), beside a notebook that
exercises every widget kind the lessons use; every lesson is checked to take those widgets from parlab.views.widgets.

Select these tests with `-m notebooks`, or leave them out with `-m "not notebooks"`.
"""

from __future__ import annotations

import ast
import datetime
import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
CELL_TIMEOUT = 120  # s; a stalled cell ends at this timeout (its reply is then found), which the wall-time check sees


def _kernel_env() -> dict[str, str]:
    """The kernel's environment as nbconvert's would be: pytest's PYTEST_CURRENT_TEST makes ipykernel drop what
    forked processes print, so leave it out; the repository under test comes first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _seconds(start: str, end: str) -> float:
    parse = datetime.datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def cell_seconds(nb) -> list[float]:
    """Each executed code cell's time in the kernel: from 'busy' to 'idle' on IOPub (the kernel's timestamps)."""
    times = []
    for cell in nb.cells:
        stamps = cell.get("metadata", {}).get("execution", {})
        if cell.cell_type == "code" and "iopub.status.busy" in stamps and "iopub.status.idle" in stamps:
            times.append(_seconds(stamps["iopub.status.busy"], stamps["iopub.status.idle"]))
    return times


def execute(path: Path, timeout: int = CELL_TIMEOUT):
    """Execute a notebook as nbconvert does (fresh kernel, the notebook's folder as working directory).

    Returns (executed notebook, wall seconds including kernel start and shutdown)."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    began = time.perf_counter()
    client.execute(env=_kernel_env())
    return nb, time.perf_counter() - began


# ipywidgets' interact, interactive, interact_manual taken from ipywidgets (import or attribute): in a lesson they
# stall headless execution now and then (parlab/views/widgets.py); parlab.views.widgets has the same three.
FRONT_END_CAPTURE = re.compile(
    r"from\s+ipywidgets(\.widgets)?(\.interaction)?\s+import\s+[^\n]*\binteract|\b(ipywidgets|widgets)\.interact"
)


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lessons_take_interact_from_parlab_widgets(path):
    nb = nbformat.read(path, as_version=4)
    found = [
        (i, line.strip())
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for line in cell.source.splitlines()
        if FRONT_END_CAPTURE.search(line)
    ]
    assert not found, (
        f"{path.name} uses ipywidgets' interact (cell, line): {found}; use `from parlab.views.widgets import interact` "
        "(same arguments): ipywidgets' can stall `jupyter nbconvert --execute` (see parlab/views/widgets.py)"
    )


HEADLESS = [p for p in LESSONS if p.stem.startswith("00_")]  # see the module docstring: nbval runs all lessons


@pytest.mark.notebooks
@pytest.mark.parametrize("path", HEADLESS, ids=[p.stem for p in HEADLESS])
def test_lesson_executes_headless_without_stalling(path):
    nb, wall = execute(path)
    times = cell_seconds(nb)
    assert times, f"{path.name}: no cell execution timestamps recorded"
    busy = sum(times)
    slowest = sorted(((t, i) for i, t in enumerate(times)), reverse=True)[:3]
    assert wall <= 1.5 * busy + 10, (
        f"{path.name}: executing took {wall:.1f} s, its cells {busy:.1f} s in the kernel (slowest code cells "
        f"{[(f'{t:.1f} s', f'code cell {i}') for t, i in slowest]}): nbclient waited for something else, "
        "e.g. a widget's front-end capture (use parlab.views.widgets.interact, see parlab/views/widgets.py)"
    )


# ------------------------------------------------------------- parlab.views.widgets: what the lessons' widgets show

WIDGET_CELLS = [
    "from ipywidgets import IntSlider\nfrom IPython.display import HTML, display\n"
    "from parlab.views.widgets import interact",
    "def f(x):\n"
    "    print('first', x)\n"
    "    handle = display(HTML('<i>0/3</i>'), display_id=True)\n"
    "    for i in range(1, 4):\n"
    "        handle.update(HTML(f'<i>{i}/3</i>'))\n"
    "    for i in range(100):\n"
    "        display(HTML(f'<b>{i}</b>'))\n"
    "    print('last')\n"
    "    if x == 2:\n"
    "        raise ValueError('x is 2')\n"
    "    return x * 10\n"
    "w = interact(f, x=IntSlider(1, 0, 4)).widget",
    "w.children[0].value = 2  # as a student moving the slider",
    "print('done')",
    # A long run shows its output as it goes: the Output widget's state changes while the function runs.
    "import time\n"
    "from parlab.views.widgets import interact_manual\n"
    "def slow(n):\n"
    "    for i in range(n):\n"
    "        print(i)\n"
    "        time.sleep(0.3)\n"
    "v = interact_manual(slow, n=IntSlider(4, 0, 8)).widget\n"
    "texts = []\n"
    "v.out.observe(lambda change: texts.append(''.join(o.get('text', '') for o in change['new'])), names='outputs')\n"
    "v.manual_button.click()\n"
    "print(texts)",
]


@pytest.mark.notebooks
def test_parlab_interact_shows_outputs_in_order_without_stalling(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in WIDGET_CELLS])
    path = tmp_path / "widgets.ipynb"
    nbformat.write(nb, path)
    nb, wall = execute(path, timeout=30)
    assert wall <= 1.5 * sum(cell_seconds(nb)) + 10
    # The Output widget's final state, as the executed notebook stores it (what a reader of the file sees).
    states = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"].values()
    shown = [s["state"]["outputs"] for s in states if s["model_name"] == "OutputModel"]
    (outputs,) = [o for o in shown if len(o) > 100]  # f's (the other is slow's)
    # After the slider moved to 2: stdout, the progress line (updated in place to its last state), 100 displays,
    # stdout, then the error; the first call's outputs were cleared.
    kinds = [o["output_type"] for o in outputs]
    assert kinds == ["stream", "display_data"] + ["display_data"] * 100 + ["stream", "error"]
    assert outputs[0]["text"] == "first 2\n"
    assert outputs[1]["data"]["text/html"] == "<i>3/3</i>"
    assert [o["data"]["text/html"] for o in outputs[2:102]] == [f"<b>{i}</b>" for i in range(100)]
    assert outputs[102]["text"] == "last\n"
    assert outputs[103]["ename"] == "ValueError" and outputs[103]["evalue"] == "x is 2"
    assert nb.cells[3].outputs[0]["text"] == "done\n"
    (printed,) = [o["text"] for o in nb.cells[4].outputs if o["output_type"] == "stream"]
    texts = ast.literal_eval(printed)  # the Output widget's text after each state change
    assert texts[-1] == "0\n1\n2\n3\n" and len(texts) >= 2 and all("0\n1\n2\n3\n".startswith(t) for t in texts)
