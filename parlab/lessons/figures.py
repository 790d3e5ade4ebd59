"""A lesson's figures as files for a slide deck: `python -m parlab figures --lesson 03 --out DIR`.

Each plotly figure of notebooks/NN_*.ipynb becomes
    DIR/NN_figKK_<id>.html   interactive (hover, zoom), a few KB: every page loads the one DIR/plotly.min.js beside
                             it (written once), so the folder opens offline, from disk, with no server
    DIR/NN_figKK_<id>.png    and .svg, where a static renderer works here (plotly's kaleido, which drives a
                             Chromium: Debian's /usr/bin/chromium is used when BROWSER_PATH is not set); a replay's
                             play buttons and slider are left out of them (a picture cannot play)
and DIR/index.html shows them all, a thumbnail (the PNG) and the title per figure. <id> is the figure's own id
(`layout.meta.id`) where it has one, else its whole title as a slug; a figure with no title gets one (the lesson,
its number and cell), so every slide it lands on has a title. Where no static renderer works, the command says why
and writes the HTML only.

Where the figures come from: by default the outputs stored in the notebook (what nbval checks; no execution, a
second); with --execute the notebook is run first (nbclient, a fresh kernel) and its new outputs are used. Figures
shown inside a widget (an `interact`) are taken from the widget state saved with the notebook, for the value the
widget was saved at.

No torch here: this command starts fast and works without the rank server.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: notebooks/ beside parlab/
NOTEBOOKS = ROOT / "notebooks"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
STATIC_FORMATS = ("png", "svg")
WIDTH, HEIGHT = 1000, 500  # pixels of a static figure that does not say its own size
PLOTLY_JS = "plotly.min.js"  # beside the pages; plotly's to_html links a name ending .js instead of inlining it


@dataclass
class Figure:
    cell: int  # index of the notebook cell that showed it
    spec: dict  # the plotly figure as JSON ({"data": [...], "layout": {...}})
    in_widget: bool = False

    @property
    def title(self) -> str:
        title = (self.spec.get("layout") or {}).get("title") or {}
        text = title.get("text", "") if isinstance(title, dict) else str(title)
        return re.sub(r"<[^>]+>", " ", text).strip()


def lesson_notebook(lesson: str, folder: Path = NOTEBOOKS) -> Path:
    """notebooks/NN_*.ipynb for "03", "3" or a name ("pipeline" matches 03_pipeline_parallel.ipynb)."""
    if not lesson.strip():
        names = ", ".join(p.stem for p in sorted(folder.glob("*.ipynb")))
        raise ValueError(f"--lesson is empty: give a number or a name (lessons: {names})")
    lesson = lesson.strip()
    key = f"{int(lesson):02d}_" if lesson.isdigit() else lesson.lower()
    found = sorted(p for p in folder.glob("*.ipynb") if (p.name.startswith(key) if key[0].isdigit() else key in p.name))
    if not found:
        names = ", ".join(p.stem for p in sorted(folder.glob("*.ipynb")))
        raise ValueError(f"no lesson {lesson!r} in {folder} (lessons: {names})")
    return found[0]


def _widget_outputs(model_id: str, state: dict, seen: set) -> list[dict]:
    """The outputs held by an Output widget at or under `model_id` (an interact is a box holding one)."""
    if model_id in seen or model_id not in state:
        return []
    seen.add(model_id)
    model = state[model_id].get("state", {})
    outputs = list(model.get("outputs", []))
    for child in model.get("children", []):
        outputs += _widget_outputs(str(child).removeprefix("IPY_MODEL_"), state, seen)
    return outputs


def notebook_figures(nb: dict) -> list[Figure]:
    """Every plotly figure a notebook shows, in cell order: its outputs, then those inside its widgets."""
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    found = []
    for index, cell in enumerate(nb["cells"]):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PLOTLY_MIME in data:
                found.append(Figure(index, data[PLOTLY_MIME]))
            elif WIDGET_MIME in data:
                for inner in _widget_outputs(data[WIDGET_MIME]["model_id"], state, set()):
                    if PLOTLY_MIME in inner.get("data", {}):
                        found.append(Figure(index, inner["data"][PLOTLY_MIME], in_widget=True))
    return found


def read_notebook(path: Path, execute: bool = False, timeout: int = 600) -> dict:
    """The notebook as JSON; with execute, after running it in a fresh kernel in its own folder."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    if execute:
        from nbclient import NotebookClient

        NotebookClient(
            nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        ).execute()
    return json.loads(nbformat.writes(nb))


def _slug(text: str, limit: int = 80) -> str:
    """A file-name-safe form of a title, cut at a word boundary (never mid-word) when longer than `limit`."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if len(slug) > limit:
        slug = slug[: limit + 1].rsplit("-", 1)[0]
    return slug or "figure"


def page_title(figure: Figure) -> str:
    """The title the figure's spec carries (with_title gave every figure one)."""
    title = (figure.spec.get("layout") or {}).get("title")
    return str((title.get("text") if isinstance(title, dict) else title) or figure.title)


def _plain(title: str) -> str:
    """A plotly title as plain text: its <br> line breaks a space, other tags dropped."""
    return re.sub(r"<[^>]+>", "", title.replace("<br>", " "))


def figure_id(figure: Figure) -> str:
    """The figure's own id (`layout.meta.id`, a string), else its title as a slug."""
    meta = (figure.spec.get("layout") or {}).get("meta")
    given = meta.get("id") if isinstance(meta, dict) else None
    return _slug(given if isinstance(given, str) and given.strip() else figure.title)


def with_title(figure: Figure, notebook: Path, number: int) -> dict:
    """The figure's spec with a title: its own, or where it has none, which lesson, figure and cell it is."""
    if figure.title:
        return figure.spec
    layout = dict(figure.spec.get("layout") or {})
    layout["title"] = {"text": f"Lesson {notebook.stem.split('_')[0]}, figure {number} (cell {figure.cell})"}
    return {**figure.spec, "layout": layout}


def without_controls(spec: dict) -> dict:
    """A replay's spec for a picture: no play buttons, slider or frames (the figure as it opens: the whole run)."""
    layout = {k: v for k, v in (spec.get("layout") or {}).items() if k not in ("updatemenus", "sliders")}
    return {**{k: v for k, v in spec.items() if k != "frames"}, "layout": layout}


def static_renderer() -> str | None:
    """None if PNG/SVG export can work here, else why not (in words). Points kaleido at Debian's Chromium."""
    import importlib.util

    if importlib.util.find_spec("kaleido") is None:
        return "plotly's static renderer (kaleido) is not installed: pip install 'parlab[present]'"
    if not os.environ.get("BROWSER_PATH"):
        browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if browser is None:
            return "kaleido needs a Chromium or Chrome: apt-get install chromium (or set BROWSER_PATH)"
        os.environ["BROWSER_PATH"] = browser
    return None


def check_out(out: Path) -> None:
    """The folder the figures go to: one that exists or can be made here, checked before any notebook is read (a
    file in its place, a file on its path, or a place this process may not write is a ValueError naming it)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a folder")
    for parent in out.parents:  # the nearest part of the path that exists must be a folder
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--out {str(out)!r} cannot be created: {str(parent)!r} is a file")
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".parlab-write-test-{os.getpid()}"
        probe.write_bytes(b"parlab")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r} cannot be created or written here: {exc.strerror or exc}") from None


def export(
    lesson: str,
    out: Path,
    formats: tuple[str, ...] = ("html", *STATIC_FORMATS),
    execute: bool = False,
    folder: Path = NOTEBOOKS,
) -> tuple[list[Path], list[str]]:
    """Write the lesson's figures to `out`; returns (files written, notes for the user)."""
    import plotly.io as pio

    path = lesson_notebook(lesson, folder)
    check_out(out)
    figures = notebook_figures(read_notebook(path, execute))
    prefix = path.stem.split("_")[0]
    written, notes, stems = [], [], []
    if "html" in formats and figures:
        written.append(_write_plotly_js(out))
    for k, figure in enumerate(figures, start=1):
        figure = replace(figure, spec=with_title(figure, path, k))
        stem = f"{prefix}_fig{k:02d}_{figure_id(figure)}"
        stems.append((stem, figure))
        if "html" in formats:
            target = out / f"{stem}.html"
            page = pio.to_html(figure.spec, include_plotlyjs=PLOTLY_JS, full_html=True, validate=False)
            title = html.escape(_plain(page_title(figure)))  # the browser tab's name: plotly's page has none
            target.write_text(
                page.replace('<meta charset="utf-8" />', f'<meta charset="utf-8" /><title>{title}</title>', 1)
            )
            written.append(target)
    static = [f for f in formats if f in STATIC_FORMATS]
    if static and figures:
        why = static_renderer()
        if why is None:
            try:
                specs = [without_controls(figure.spec) for _, figure in stems for _ in static]
                targets = [out / f"{stem}.{fmt}" for stem, _ in stems for fmt in static]
                # The size the notebook drew it at (kaleido's own default, 700 x 500, squeezes subplots together);
                # PNGs at twice the pixels, sharp on a projector.
                layouts = [(figure.spec.get("layout") or {}) for _, figure in stems for _ in static]
                sizes = [(lay.get("width") or WIDTH, lay.get("height") or HEIGHT) for lay in layouts]
                renders = list(zip(specs, targets, sizes, strict=True))
                missing = _write_static(renders)
                for _ in range(2):  # those not written (seen in a run of the suite, twice in a row once), each alone
                    retry = [render for render in renders if render[1] in missing]
                    missing = [target for render in retry for target in _write_static([render])]
                written += [t for t in targets if t not in missing]
                if missing:
                    why = (
                        f"static export failed: kaleido wrote no file for {len(missing)} of {len(targets)} "
                        f"(first: {missing[0].name}; plotly does not pass kaleido's errors on)"
                    )
            except Exception as exc:  # a renderer that is installed but cannot start (no display, sandbox, ...)
                why = f"static export failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if why is not None:
            notes.append(f"no {'/'.join(static).upper()} written: {why}")
    if "html" in formats:
        written.append(_index(out, path, stems, static if not notes else []))
    if not figures:
        notes.append(f"{path.name} has no stored plotly figures (run it, or pass --execute)")
    return written, notes


def _write_static(renders: list[tuple[dict, Path, tuple[int, int]]]) -> list[Path]:
    """Render each (spec, target, (width, height)) with kaleido, PNG or SVG by the target's name, at scale 2;
    returns the targets not written.

    plotly's write_images asks kaleido to go on past a failed render and drops the errors kaleido returns (plotly 6),
    so a figure that failed is seen only as a file that is not there."""
    import plotly.io as pio

    specs, targets, sizes = (list(column) for column in zip(*renders, strict=True))
    for target in targets:
        target.unlink(missing_ok=True)  # (a file left by an earlier export would hide a failure)
    pio.write_images(specs, targets, scale=2, validate=False, width=[w for w, _ in sizes], height=[h for _, h in sizes])
    return [t for t in targets if not (t.exists() and t.stat().st_size > 0)]


def _write_plotly_js(out: Path) -> Path:
    """DIR/plotly.min.js, the one copy of plotly.js every page of the folder loads (the version plotly.py ships)."""
    from plotly.offline import get_plotlyjs

    target = out / PLOTLY_JS
    target.write_text(get_plotlyjs(), encoding="utf-8")
    return target


INDEX_STYLE = (
    "body{font-family:sans-serif;margin:2em}ol{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:1.5em}"
    "li{width:330px}img{width:320px;border:1px solid #ccc}.none{width:320px;height:120px;border:1px dashed #ccc;"
    "display:flex;align-items:center;justify-content:center;color:#777}"
)


def _index(out: Path, notebook: Path, stems: list[tuple[str, Figure]], static: list[str]) -> Path:
    """DIR/index.html: a card per figure, its PNG as a thumbnail (where one was written), its title, its files."""
    rows = []
    for stem, figure in stems:
        links = " ".join(f'<a href="{stem}.{fmt}">{fmt}</a>' for fmt in ("html", *static))
        where = f"cell {figure.cell}" + (" (inside a widget)" if figure.in_widget else "")
        title = html.escape(figure.title or stem)
        thumb = (
            f'<a href="{stem}.html"><img src="{stem}.png" alt="{title}" loading="lazy"></a>'
            if "png" in static
            else '<div class="none">no picture: HTML only</div>'
        )
        rows.append(f"<li>{thumb}<p><b>{title}</b> <small>({where})</small><br>{links}</p></li>")
    page = (
        f"<!doctype html><meta charset=utf-8><title>{notebook.stem}</title><style>{INDEX_STYLE}</style>"
        f"<h1>Figures of {notebook.name}</h1>"
    )
    target = out / "index.html"
    target.write_text(page + "<ol>" + "".join(rows) + "</ol>\n")
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lesson", required=True, help="lesson number or name (03, 3, pipeline)")
    parser.add_argument("--out", required=True, type=Path, help="folder to write the figures to (created)")
    parser.add_argument(
        "--format",
        default="html,png,svg",
        help="comma-separated: html (interactive, standalone), png, svg (default: all three)",
    )
    parser.add_argument("--execute", action="store_true", help="run the notebook first instead of reading its outputs")


def main(args: argparse.Namespace) -> int:
    """`python -m parlab figures`: the files written, one per line, then any note; exit status 2 on bad input."""
    import sys

    formats = tuple(f.strip().lower() for f in args.format.split(",") if f.strip())
    bad = [f for f in formats if f not in ("html", *STATIC_FORMATS)]
    if bad or not formats:
        print(f"parlab: error: --format {args.format!r}: choose from html, png, svg", file=sys.stderr)
        return 2
    try:
        written, notes = export(args.lesson, args.out, formats, args.execute)
    except ValueError as exc:
        print(f"parlab: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the folder was checked; a write can still fail (a full disk, a folder removed meanwhile)
        print(f"parlab: error: writing the figures to {str(args.out)!r}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    for note in notes:
        print(f"parlab: {note}", file=sys.stderr)
    return 0
