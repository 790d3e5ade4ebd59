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
    a cell that would make its slide too tall      subslide     (see below)

A slide must fit a projector at 1280x720. The notebook does not know how tall a cell renders, so the rules use an
honest estimate (`cell_height`: markdown and code lines at the slide's line heights, a plotly figure at its own
layout height, a widget at a figure's): a cell that would take its slide past `SCREEN_PX` starts a subslide of its
own instead of sharing one. A single cell taller than the screen still scrolls (`metadata.rise.scroll`); the
lessons' test keeps their number small.

Live cells (a run drawn as it goes, a replay, a widget to play with: what an instructor runs in front of the class)
get the cell tag "live" and `metadata.parlab.live = true`, so they stand out in the notebook and in the slides.
The notebook's `metadata.rise` sets the slideshow's look: scrolling slides (figures are tall), no transitions.

nbval's comment markers (`# NBVAL_IGNORE_OUTPUT` as a cell's first line) would be the first thing a class reads on
a slide, so the tool turns each into nbval's own cell tag (`nbval-ignore-output`), which nbval reads the same way
and the slides do not show.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

# "white": its fonts ship with RISE (the "simple" theme fetches Google's: offline, two console errors);
# notebooks/rise.css undoes its upper-case headings.
RISE = {"autolaunch": False, "scroll": True, "theme": "white", "transition": "none", "start_slideshow_at": "beginning"}
# A code cell that an instructor runs live: a live timeline, a replay, a widget.
# nbval's comment markers, a line of their own, and the cell tag nbval reads instead (nbval's plugin lower-cases
# the marker and turns "_" into "-").
NBVAL_MARKER = re.compile(r"^[ \t]*#[ \t]*(NBVAL_[A-Z_]+)[ \t]*\n?", re.MULTILINE)
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


# The estimate behind "fits the screen": pixels on a RISE slide at 1280x720 with notebooks/rise.css (18 px body,
# 15 px code), fitted to every lesson's (sub)slides as benchmarks/slides_in_rise.py measured them in Chromium
# (code input 0.91 and printed output 0.84 of the first, eyeballed constants; markdown 0.75; plotly 0.97). A widget
# is counted at a figure's height, as the notebook view shows it (RISE 0.43's page shows it as one line of text).
SCREEN_PX = 720 - 60  # the slide area less reveal.js's margins and controls
MARKDOWN_LINE_PX, MARKDOWN_CHARS, HEADING_PX, SUBHEADING_PX, BLANK_PX = 22, 90, 56, 40, 8
CODE_LINE_PX, OUTPUT_LINE_PX, OUTPUT_CHARS, CELL_PADDING_PX, FENCED_LINE_PX = 20, 17, 135, 10, 15
FIGURE_PX, WIDGET_PX, TABLE_ROW_PX = 450, 520, 10
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"  # an ipywidgets output


def _markdown_px(text: str) -> int:
    height, fenced = 16, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):  # a code block: its lines at the code's line height, unwrapped
            fenced = not fenced
            height += BLANK_PX
        elif fenced:
            height += FENCED_LINE_PX
        elif re.match(r"#{1,2} ", line):
            height += HEADING_PX
        elif re.match(r"#{3,6} ", line):
            height += SUBHEADING_PX
        elif not line.strip():
            height += BLANK_PX
        else:
            height += MARKDOWN_LINE_PX * max(1, -(-len(line) // MARKDOWN_CHARS))  # wrapped lines
    return height


def _output_px(output: dict) -> int:
    if output["output_type"] == "stream":
        text = output.get("text", "")
        lines = ("".join(text) if isinstance(text, list) else text).splitlines()
        return sum(OUTPUT_LINE_PX * max(1, -(-len(line) // OUTPUT_CHARS)) for line in lines)
    data = output.get("data", {})
    if "application/vnd.plotly.v1+json" in data:
        return int(data["application/vnd.plotly.v1+json"].get("layout", {}).get("height", FIGURE_PX))
    if WIDGET_MIME in data:
        return WIDGET_PX
    joined = {key: "".join(value) if isinstance(value, list) else str(value) for key, value in data.items()}
    if "text/markdown" in joined:
        return _markdown_px(joined["text/markdown"])
    if "text/html" in joined:  # a table, a progress bar; an emptied one (a launch's finished bar) takes no room
        html = joined["text/html"].strip()
        return TABLE_ROW_PX * (html.count("<tr") + 2) if html else 0
    if "text/plain" in joined:
        return OUTPUT_LINE_PX * len(joined["text/plain"].splitlines())
    return 0


def cell_height(cell: dict) -> int:
    """The estimated height in pixels of a cell on a slide: its source, and a code cell's outputs."""
    if cell["cell_type"] == "markdown":
        return _markdown_px(_source(cell))
    if cell["cell_type"] != "code":
        return 0
    code = CODE_LINE_PX * len(_source(cell).splitlines()) + CELL_PADDING_PX
    return code + sum(_output_px(output) for output in cell.get("outputs", []))


def slide_types(cells: list[dict]) -> list[str]:
    """The RISE slide type of each cell, by the rules in the module docstring."""
    types = [_structural_type(cell, previous) for previous, cell in _with_previous(cells)]
    # Split what would not fit: a cell sharing a (sub)slide starts its own subslide when the (sub)slide would pass
    # the screen with it.
    height = 0
    for index, (cell, kind) in enumerate(zip(cells, types, strict=True)):
        if kind == "skip":
            continue
        tall = cell_height(cell)
        if kind in ("-", "fragment") and height and height + tall > SCREEN_PX:
            kind = types[index] = "subslide"
        height = tall if kind in ("slide", "subslide") else height + tall
    return types


def _with_previous(cells: list[dict]):
    previous = None
    for cell in cells:
        yield previous, cell
        previous = cell


def _structural_type(cell: dict, previous: dict | None) -> str:
    """A cell's slide type from the notebook's structure alone (headings, code, imports)."""
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
    return kind


def is_live(cell: dict) -> bool:
    return cell["cell_type"] == "code" and bool(LIVE_CODE.search(_source(cell)))


def nbval_tags(cell: dict) -> list[str]:
    """The nbval comment markers in a code cell's source, as nbval's cell tags ("NBVAL_SKIP" -> "nbval-skip")."""
    if cell["cell_type"] != "code":
        return []
    return [m.group(1).lower().replace("_", "-") for m in NBVAL_MARKER.finditer(_source(cell))]


def add_slides(nb: dict) -> dict:
    """A copy of the notebook (nbformat JSON) with slide metadata on every cell and RISE settings; outputs and other
    metadata unchanged; the only change to a source is an nbval comment marker moved into the cell's tags."""
    nb = copy.deepcopy(nb)
    for cell, kind in zip(nb["cells"], slide_types(nb["cells"]), strict=True):
        meta = cell.setdefault("metadata", {})
        meta["slideshow"] = {"slide_type": kind}
        markers = nbval_tags(cell)
        if markers:
            cell["source"] = NBVAL_MARKER.sub("", _source(cell))
        tags = [t for t in meta.get("tags", []) if t != "live"]
        tags += [t for t in markers if t not in tags]
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
