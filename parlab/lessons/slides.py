"""Every lesson as a slideshow (RISE in JupyterLab: `pip install 'parlab[present]'`, then the notebook's
"Render as slideshow" button, or Alt-R), with the slide metadata derived from the notebook's own structure:

    python -m parlab.lessons.slides notebooks/*.ipynb          write the slide metadata into the lessons
    python -m parlab.lessons.slides --check notebooks/*.ipynb  exit 1 if a lesson's stored metadata is not what it
                                                               would be

The rules (one idea per slide; the same notebook always gets the same metadata, and running it twice changes
nothing):

    the title cell ("# 03 · ...")                  slide        the lesson's title slide
    a "## ..." heading (a cell that has one)       slide        one section of the lesson, one idea
    the cell right after a heading                 -            on the heading's slide
    a code cell further down                       subslide     each run / figure on its own (vertical) slide
    a markdown cell after that                     fragment     the explanation appears under its figure
    a code cell of imports only                    skip         set-up the class need not read (it still runs)

Live cells (a run drawn as it goes, a replay, a widget to play with: what an instructor runs in front of the class)
get the cell tag "live" and `metadata.parlab.live = true`, so they stand out in the notebook and in the slides.
The notebook's `metadata.rise` sets the slideshow's look: scrolling slides (figures are tall), no transitions.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

RISE = {"autolaunch": False, "scroll": True, "theme": "simple", "transition": "none", "start_slideshow_at": "beginning"}
# A code cell that an instructor runs live: a live timeline, a replay, a widget.
LIVE_CODE = re.compile(r"\blive\s*=\s*True|\bparlab\.live\(|\blive\(|\breplay\(|\binteract(_manual)?\b|\bwidgets\.")
IMPORT_LINE = re.compile(r"^\s*(#.*|import\s.+|from\s+\S+\s+import\s.+|\)|[\w\s,]+,?|)$")


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _heading(cell: dict) -> int:
    """The level of the cell's top markdown heading: the one it starts with, or a "## " further down (some cells
    end one section's explanation and open the next); 0 if none."""
    if cell["cell_type"] != "markdown":
        return 0
    levels = [len(m.group(1)) for m in re.finditer(r"^(#{1,6})\s", _source(cell).lstrip(), re.MULTILINE)]
    first = levels[0] if levels and _source(cell).lstrip().startswith("#") else 0
    return first if first else min((lv for lv in levels if lv <= 2), default=0)


def _title(cell: dict) -> str:
    """The text of the cell's top heading (see _heading)."""
    level = _heading(cell)
    for line in _source(cell).splitlines():
        if line.startswith("#" * level + " "):
            return line[level:].strip()
    return ""


def _imports_only(cell: dict) -> bool:
    code = _source(cell).strip()
    return bool(code) and all(IMPORT_LINE.match(line) for line in code.splitlines()) and "import" in code


def slide_types(cells: list[dict]) -> list[str]:
    """The RISE slide type of each cell, by the rules in the module docstring."""
    types, previous = [], None
    for cell in cells:
        level = _heading(cell)
        if level in (1, 2):
            kind = "slide"
        elif previous is not None and _heading(previous) in (1, 2, 3):
            kind = "-"  # the first cell under a heading shares its slide
        elif level == 3:
            kind = "subslide"
        elif cell["cell_type"] == "code":
            kind = "skip" if _imports_only(cell) else "subslide"
        else:
            kind = "fragment"
        if cell["cell_type"] == "code" and _imports_only(cell) and kind != "slide":
            kind = "skip"
        types.append(kind)
        previous = cell
    return types


def is_live(cell: dict) -> bool:
    return cell["cell_type"] == "code" and bool(LIVE_CODE.search(_source(cell)))


def add_slides(nb: dict) -> dict:
    """A copy of the notebook (nbformat JSON) with slide metadata on every cell and RISE settings; sources,
    outputs and other metadata unchanged."""
    nb = copy.deepcopy(nb)
    for cell, kind in zip(nb["cells"], slide_types(nb["cells"]), strict=True):
        meta = cell.setdefault("metadata", {})
        meta["slideshow"] = {"slide_type": kind}
        tags = [t for t in meta.get("tags", []) if t != "live"]
        parlab_meta = {k: v for k, v in meta.get("parlab", {}).items() if k != "live"}
        if is_live(cell):
            tags.append("live")
            parlab_meta["live"] = True
        if tags:
            meta["tags"] = tags
        else:
            meta.pop("tags", None)
        if parlab_meta:
            meta["parlab"] = parlab_meta
        else:
            meta.pop("parlab", None)
    nb.setdefault("metadata", {})["rise"] = dict(RISE)
    return nb


def slides(nb: dict) -> list[dict]:
    """The slideshow as data: [{"title", "cells": [cell indices], "subslides": n, "live": n}] per slide."""
    shown = []
    for index, cell in enumerate(nb["cells"]):
        kind = cell.get("metadata", {}).get("slideshow", {}).get("slide_type", "-")
        if kind == "slide" or not shown:
            title = _title(cell)
            shown.append({"title": title, "cells": [], "subslides": 0, "live": 0})
        if kind == "skip":
            continue
        shown[-1]["cells"].append(index)
        shown[-1]["subslides"] += kind == "subslide"
        shown[-1]["live"] += "live" in cell.get("metadata", {}).get("tags", [])
    return shown


def _write(path: Path, nb: dict) -> None:
    import nbformat

    path.write_text(nbformat.writes(nbformat.from_dict(nb)) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parlab.lessons.slides", description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook is not up to date")
    args = parser.parse_args(argv)
    import nbformat

    stale = []
    for path in args.notebooks:
        nb = nbformat.read(path, as_version=4)
        wanted = add_slides(nb)
        if wanted == nb:
            continue
        stale.append(path)
        if not args.check:
            _write(path, wanted)
        count = len(slides(wanted))
        print(f"{path}: {'needs' if args.check else 'wrote'} slide metadata ({count} slides)")
    if args.check and stale:
        print(f"run: python -m parlab.lessons.slides {' '.join(str(p) for p in stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
