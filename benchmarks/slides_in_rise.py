"""Every lesson as RISE presents it: each (sub)slide measured in Chromium at a projector's 1280x720.

The lesson notebooks carry slide metadata derived by `parlab.lessons.slides`, whose `cell_height` only estimates how
tall a cell renders. This test measures instead: a copy of each lesson, with its stored outputs and not executed
(what a class opens), is served by JupyterLab with jupyterlab-rise, and RISE's own slideshow page
(`/rise/<notebook>`, what the notebook's "Render as slideshow" button shows) is opened in Debian's Chromium with a
1280x720 viewport. Every slide and sub-slide is visited (reveal.js's `#/h/v` address) and measured: the height on
screen of its cells from the top of the first to the bottom of the last (fragments included: reveal.js keeps their
place while hidden), each cell's parts by kind (markdown, code input, stream, plotly, widget, HTML, other output),
its title, its body text size. The browser's console errors and warnings are kept with their text.

    python benchmarks/slides_in_rise.py [notebooks/NN_x.ipynb ...]   measure; write test-artifacts/slides/
    PARLAB_RISE='{"width": 960}' ...      try metadata.rise settings;  PARLAB_NO_RISE_CSS=1: without notebooks/rise.css

It prints, per lesson, the (sub)slides taller than the screen (indices h/v and cell indices), the measured/estimated
ratio per kind, and the console errors; slides.csv has one row per (sub)slide, slides.json each cell's parts too.
A script, not a test: all twelve lessons take 8-10 min on this machine's 2 shared cores (25-80 s a lesson: RISE
builds every cell of a notebook before it shows the first slide), and the page always logs RISE's own errors (see
the README's slides section).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the lab helpers of tests/test_browser.py
from test_browser import CHROMIUM_ARGS, Deadline, Lab, find_chromium  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ARTIFACTS = ROOT / "test-artifacts" / "slides"
VIEWPORT = {"width": 1280, "height": 720}
BUDGET_S = 900.0  # a guard against hangs for all lessons together (25-80 s a lesson here, on 2 busy cores)

# The present (sub)slide, measured: on-screen pixels (reveal.js's scale included), each cell by its index in the
# notebook (RISE keeps JupyterLab's data-windowed-list-index), each cell's parts by kind.
MEASURE_JS = """
() => {
  const slide = document.querySelector('.reveal .slides > section.present > section.present')
      || document.querySelector('.reveal .slides > section.present');
  if (!slide) return null;
  const cells = [...slide.querySelectorAll('.jp-Cell')];
  const kindOf = (out) => {
    const mime = out.getAttribute('data-mime-type') || '';
    if (out.classList.contains('jp-RenderedPlotly')) return 'plotly';
    // A widget RISE cannot draw shows its text/plain fallback, "Interactive(children=(IntSlider(...": a widget still.
    if (out.classList.contains('jupyter-widgets') || out.querySelector('.jupyter-widgets')
        || /^[A-Z]\\w*\\((children|value|description|layout)=/.test(out.innerText)) return 'widget';
    if (mime === 'application/vnd.jupyter.widget-view+json') return 'widget';
    if (mime.startsWith('application/vnd.jupyter.std')) return 'stream';
    if (mime === 'text/html') return 'html';
    if (mime === 'text/markdown') return 'markdown_output';
    return 'other_output';
  };
  const parts = cells.map((cell) => {
    const box = cell.getBoundingClientRect();
    const part = {index: Number(cell.getAttribute('data-windowed-list-index')), top: box.top, bottom: box.bottom,
                  kinds: {}};
    if (cell.classList.contains('jp-MarkdownCell')) part.kinds.markdown = box.height;
    else {
      const input = cell.querySelector('.jp-Cell-inputWrapper');
      part.kinds.code = input ? input.getBoundingClientRect().height : 0;
      for (const out of cell.querySelectorAll('.jp-OutputArea-output')) {
        const k = kindOf(out);
        part.kinds[k] = (part.kinds[k] || 0) + out.getBoundingClientRect().height;
      }
    }
    return part;
  });
  const top = Math.min(...parts.map((p) => p.top)), bottom = Math.max(...parts.map((p) => p.bottom));
  const heading = slide.querySelector('h1, h2, h3');
  const firstText = cells.length ? cells[0].innerText.trim().split('\\n')[0] : '';
  const para = slide.querySelector('.jp-RenderedMarkdown p');
  const scale = document.querySelector('.reveal .slides').getBoundingClientRect().width
      / (document.querySelector('.reveal .slides').offsetWidth || 1);
  return {cells: parts, height: cells.length ? bottom - top : 0, title: heading ? heading.innerText.trim() : '',
          first_line: firstText.slice(0, 120),
          body_px: para ? parseFloat(getComputedStyle(para).fontSize) * scale : null,
          screen: window.innerHeight, scale: scale,
          nbval_marker: /#\\s*NBVAL_/.test(slide.innerText)};
}
"""

STACKS_JS = """
() => [...document.querySelectorAll('.reveal .slides > section')].map(
    (h) => Math.max(1, h.querySelectorAll(':scope > section').length))
"""


def kind_estimates(cell: dict) -> dict[str, int]:
    """parlab.lessons.slides' estimate of a cell, split into the kinds MEASURE_JS measures."""
    from parlab.lessons import slides

    if cell["cell_type"] == "markdown":
        return {"markdown": slides.cell_height(cell)}
    source = slides._source(cell)
    parts = {"code": slides.CODE_LINE_PX * len(source.splitlines()) + slides.CELL_PADDING_PX}
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        if output["output_type"] == "stream":
            kind = "stream"
        elif "application/vnd.plotly.v1+json" in data:
            kind = "plotly"
        elif "application/vnd.jupyter.widget-view+json" in data:
            kind = "widget"
        elif "text/markdown" in data:
            kind = "markdown_output"
        elif "text/html" in data:
            kind = "html"
        else:
            kind = "other_output"
        parts[kind] = parts.get(kind, 0) + slides._output_px(output)
    return parts


def measure_lesson(page, lab: Lab, notebook: Path, deadline: Deadline) -> dict:
    """Open `notebook` (already in the lab's root) in RISE and measure every (sub)slide; console messages with it."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    console: list[dict] = []
    page.on("console", lambda m: console.append({"type": m.type, "text": m.text}) if m.type in ("error", "warning")
            else None)  # fmt: skip
    page.on("pageerror", lambda e: console.append({"type": "pageerror", "text": str(e)}))
    page.on("requestfailed", lambda r: console.append({"type": "requestfailed", "text": r.url}))
    started = time.monotonic()
    page.goto(f"{lab.base}/rise/{notebook.name}?token={lab.token}", timeout=deadline.left_ms())
    page.wait_for_selector(".reveal .slides > section .jp-Cell", timeout=deadline.left_ms())
    page.wait_for_timeout(1500)  # RISE syncs reveal.js again after its async_timeout (250 ms) and fonts load
    stacks = page.evaluate(STACKS_JS)
    measured = []
    for h, count in enumerate(stacks):
        for v in range(count):
            page.evaluate(f"() => {{ window.location.hash = '#/{h}/{v}'; }}")
            # Wait until reveal.js shows it and every figure on it is drawn (plotly draws on first show).
            try:
                page.wait_for_function(
                    """([h, v]) => {
                      const s = document.querySelectorAll('.reveal .slides > section')[h];
                      if (!s || !s.classList.contains('present')) return false;
                      const sub = s.querySelectorAll(':scope > section')[v] || s;
                      if (!sub.classList.contains('present')) return false;
                      return [...sub.querySelectorAll('.jp-RenderedPlotly')]
                          .every((o) => o.querySelector('svg.main-svg'));
                    }""",
                    arg=[h, v],
                    timeout=min(deadline.left_ms(), 15_000),
                )
                drawn = True
            except PlaywrightTimeout:  # measured anyway, and flagged: a figure that never drew
                drawn = False
            page.wait_for_timeout(120)
            slide = page.evaluate(MEASURE_JS)
            slide.update(h=h, v=v, drawn=drawn)
            measured.append(slide)
    return {"notebook": notebook.name, "slides": measured, "console": console, "seconds": time.monotonic() - started}


def open_lab(notebooks: list[Path], tmp: Path, deadline: Deadline, rise: dict | None = None) -> Lab:
    """A lab serving copies of `notebooks`, stored outputs kept, with the test's one kernel named in each (and
    `rise` merged into each one's metadata.rise, to try settings)."""
    root, home = tmp / "lab-root", tmp / "lab-home"
    root.mkdir(parents=True)
    home.mkdir(parents=True)
    for notebook in notebooks:
        data = json.loads(notebook.read_text())
        data.setdefault("metadata", {})["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3 (parlab test)",
            "language": "python",
        }
        data["metadata"].setdefault("rise", {}).update(rise or {})
        (root / notebook.name).write_text(json.dumps(data))
        style = notebook.parent / "rise.css"  # RISE's style sheet for every notebook in the folder
        if style.exists() and not os.environ.get("PARLAB_NO_RISE_CSS"):
            shutil.copy(style, root / style.name)
    lab = Lab(root, home)
    lab.start(deadline)
    return lab


def measure(notebooks: list[Path], tmp: Path, chromium: str, sync_playwright, rise: dict | None = None) -> list[dict]:
    deadline = Deadline(BUDGET_S)
    lab = open_lab(notebooks, tmp, deadline, rise)
    results = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                for notebook in notebooks:
                    page = browser.new_page(viewport=VIEWPORT)
                    try:
                        results.append(measure_lesson(page, lab, notebook, deadline))
                        print(f"{notebook.name}: {results[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
                        page.evaluate("() => { window.location.hash = '#/0/0'; }")
                        page.screenshot(path=str(ARTIFACTS / f"{notebook.stem}-first.png"))
                    finally:
                        page.close()
                    for kernel in lab.api("GET", "/api/kernels"):  # RISE starts one per notebook: stop it
                        lab.api("DELETE", f"/api/kernels/{kernel['id']}")
            finally:
                browser.close()
    finally:
        lab.stop()
    return results


def with_estimates(results: list[dict]) -> list[dict]:
    """One row per (sub)slide: measured height, parlab's estimate, and each cell's measured and estimated parts."""
    from parlab.lessons.slides import cell_height

    rows = []
    for result in results:
        nb = json.loads((ROOT / "notebooks" / result["notebook"]).read_text())
        for slide in result["slides"]:
            indices = [c["index"] for c in slide["cells"]]
            rows.append(
                {
                    "lesson": result["notebook"],
                    "h": slide["h"],
                    "v": slide["v"],
                    "cells": indices,
                    "title": slide["title"],
                    "first_line": slide["first_line"],
                    "height_px": round(slide["height"]),
                    "estimate_px": sum(cell_height(nb["cells"][i]) for i in indices),
                    "screen_px": slide["screen"],
                    "body_px": slide["body_px"],
                    "nbval_marker": slide["nbval_marker"],
                    "drawn": slide["drawn"],
                    "parts": [
                        {
                            "index": c["index"],
                            "measured": c["kinds"],
                            "estimate": kind_estimates(nb["cells"][c["index"]]),
                        }
                        for c in slide["cells"]
                    ],
                }
            )
    return rows


def kind_ratios(rows: list[dict]) -> dict[str, dict]:
    """Measured / estimated pixels per kind, over every cell that has the kind (sums, so big cells weigh more)."""
    totals: dict[str, list[float]] = {}
    for row in rows:
        for part in row["parts"]:
            for kind in set(part["measured"]) | set(part["estimate"]):
                m, e = part["measured"].get(kind, 0.0), part["estimate"].get(kind, 0)
                t = totals.setdefault(kind, [0.0, 0.0, 0])
                t[0], t[1], t[2] = t[0] + m, t[1] + e, t[2] + 1
    return {k: {"measured": round(m), "estimate": e, "ratio": round(m / e, 2) if e else None, "n": n}
            for k, (m, e, n) in sorted(totals.items())}  # fmt: skip


def write_artifacts(results: list[dict], rows: list[dict]) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "slides.json").write_text(json.dumps({"slides": rows, "ratios": kind_ratios(rows), "console": {
        r["notebook"]: r["console"] for r in results}, "seconds": {r["notebook"]: round(r["seconds"], 1)
        for r in results}}, indent=1))  # fmt: skip
    columns = ["lesson", "h", "v", "cells", "title", "height_px", "estimate_px", "screen_px", "body_px", "first_line"]
    with open(ARTIFACTS / "slides.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str]) -> int:
    import tempfile

    from playwright.sync_api import sync_playwright

    notebooks = [Path(a).resolve() for a in argv] or LESSONS
    chromium = find_chromium()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        rise = json.loads(os.environ.get("PARLAB_RISE", "{}"))  # e.g. '{"width": 960, "height": 540}', to try
        results = measure(notebooks, Path(tmp), chromium, sync_playwright, rise)
    rows = with_estimates(results)
    write_artifacts(results, rows)
    for lesson in dict.fromkeys(r["lesson"] for r in rows):
        mine = [r for r in rows if r["lesson"] == lesson]
        tall = [
            f"{r['h']}/{r['v']} cells {r['cells']} {r['height_px']}px" for r in mine if r["height_px"] > r["screen_px"]
        ]
        print(f"{lesson}: {len(mine)} (sub)slides, {len(tall)} taller than the screen: {tall}")
    print("measured/estimated per kind:", json.dumps(kind_ratios(rows)))
    errors = {r["notebook"]: [c["text"][:150] for c in r["console"] if c["type"] != "warning"] for r in results}
    print("console errors:", json.dumps({k: sorted(set(v)) for k, v in errors.items()}, indent=1))
    print(f"{time.monotonic() - started:.0f} s; wrote {ARTIFACTS}/slides.csv and slides.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
