"""`python -m parlab figures`: a lesson's figures as standalone files for a slide deck."""

import json
import re
from pathlib import Path

import nbformat
import plotly.graph_objects as go
import pytest

from parlab.cli import main
from parlab.lessons import figures

ROOT = Path(__file__).resolve().parents[1]


def _stored_plotly_titles(path: Path) -> list[str]:
    """Counted independently of parlab.lessons.figures: the plotly outputs of the cells, then those in widget state."""
    nb = json.loads(path.read_text())
    titles = [
        o["data"][figures.PLOTLY_MIME]["layout"]["title"]["text"]
        for cell in nb["cells"]
        for o in cell.get("outputs", [])
        if figures.PLOTLY_MIME in o.get("data", {})
    ]
    return titles


def test_figures_of_lesson_03_become_one_standalone_html_file_each(tmp_path, capsys):
    assert main(["figures", "--lesson", "03", "--out", str(tmp_path), "--format", "html"]) == 0
    written = capsys.readouterr().out.split()
    pages = sorted(p for p in tmp_path.glob("03_fig*.html"))
    assert [str(p) for p in pages] == sorted(w for w in written if Path(w).name.startswith("03_fig"))
    titles = _stored_plotly_titles(ROOT / "notebooks" / "03_pipeline_parallel.ipynb")
    assert len(titles) >= 6 and len(pages) >= len(titles)  # every output figure, plus those inside widgets
    for page, title in zip(pages, titles, strict=False):
        text = page.read_text()
        # plotly.js is the one file beside the pages (no network: the folder opens offline), not in each page
        assert 'src="plotly.min.js"' in text and "://" not in text.split("Plotly.newPlot")[0]
        assert "Plotly.newPlot" in text and len(text) < 200_000
        assert json.dumps(title)[1:-1] in text, f"{page.name} does not carry its figure {title!r}"
        tab = re.search(r"<title>(.*?)</title>", text)  # the browser tab says which figure it is
        assert tab and tab.group(1).strip() and "<br>" not in tab.group(1), page.name
    plotly_js = (tmp_path / "plotly.min.js").read_text()
    assert len(plotly_js) > 1_000_000 and str(tmp_path / "plotly.min.js") in written
    index = (tmp_path / "index.html").read_text()
    assert all(p.name in index for p in pages) and "no picture: HTML only" in index
    assert not list(tmp_path.glob("*.png"))  # --format html: no static files


def _one_figure_notebook(folder: Path) -> None:
    fig = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]), layout={"title": {"text": "Bytes per rank"}, "height": 300})
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("fig")
    cell.outputs = [nbformat.v4.new_output("display_data", data={figures.PLOTLY_MIME: fig.to_plotly_json()})]
    nb.cells = [nbformat.v4.new_markdown_cell("# 42 · test"), cell]
    nbformat.write(nb, folder / "42_test.ipynb")


def test_static_export_writes_png_and_svg_or_says_why_not(tmp_path):
    _one_figure_notebook(tmp_path)
    written, notes = figures.export("42", tmp_path / "out", ("html", "png", "svg"), folder=tmp_path)
    names = sorted(p.name for p in written)
    assert "42_fig01_bytes-per-rank.html" in names and "index.html" in names
    why = figures.static_renderer()
    if why is not None:  # no kaleido or no Chromium on this machine: HTML only, and the reason is printed
        assert notes and why in notes[0] and not list((tmp_path / "out").glob("*.png"))
        pytest.skip(why)
    assert notes == [], notes
    png = (tmp_path / "out" / "42_fig01_bytes-per-rank.png").read_bytes()
    svg = (tmp_path / "out" / "42_fig01_bytes-per-rank.svg").read_text()
    assert png.startswith(b"\x89PNG") and int.from_bytes(png[20:24], "big") == 600  # height 300 at scale 2
    assert svg.lstrip().startswith("<svg") and "Bytes per rank" in svg


@pytest.mark.parametrize("renders_failing", [1, 5])
def test_a_render_kaleido_drops_is_tried_again_then_said(tmp_path, monkeypatch, renders_failing):
    """plotly's write_images drops kaleido's errors: a figure that failed is only a file that is not there. The
    export tries each such file alone, twice more, and says so when they are still missing (it never claims a file
    it has not written). Stands in for kaleido: the first `renders_failing` calls write nothing, later ones write
    the bytes (5: none of the five calls does)."""
    import plotly.io as pio

    calls = []

    def write_images(specs, targets, **options):
        calls.append([Path(t).name for t in targets])
        if len(calls) > renders_failing:
            for target in targets:
                Path(target).write_bytes(b"image")

    monkeypatch.setattr(pio, "write_images", write_images)
    monkeypatch.setattr(figures, "static_renderer", lambda: None)
    _one_figure_notebook(tmp_path)
    written, notes = figures.export("42", tmp_path / "out", ("png", "svg"), folder=tmp_path)
    static = sorted(p.name for p in written if p.suffix in (".png", ".svg"))
    expected = ["42_fig01_bytes-per-rank.png", "42_fig01_bytes-per-rank.svg"]
    png, svg = ([name] for name in expected)
    if renders_failing == 1:  # all at once, then each missing file alone
        assert calls == [expected, png, svg]
        assert static == expected and notes == []
    else:  # all at once, then each alone, twice
        assert calls == [expected, png, svg, png, svg]
        assert static == [] and not list((tmp_path / "out").glob("*.png"))
        assert len(notes) == 1 and "kaleido wrote no file for 2 of 2" in notes[0], notes


def test_an_unknown_lesson_is_one_error_line(tmp_path, capsys):
    assert main(["figures", "--lesson", "99", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parlab: error: no lesson '99'") and err.count("\n") == 1
    assert main(["figures", "--lesson", "03", "--out", str(tmp_path), "--format", "gif"]) == 2


def test_names_come_from_the_figure_every_figure_has_a_title_and_pictures_carry_no_controls(tmp_path, monkeypatch):
    from parlab.core.trace import Event, Trace
    from parlab.views.replay import replay

    long_title = "One step of 1F1B on four ranks with eight micro-batches, measured in the ranks and drawn"
    specs = [
        go.Figure(go.Bar(x=[1]), layout={"title": {"text": long_title}}).to_plotly_json(),
        go.Figure(go.Bar(x=[1]), layout={"title": {"text": "ignored"}, "meta": {"id": "bytes-table"}}).to_plotly_json(),
        go.Figure(go.Bar(x=[1])).to_plotly_json(),  # no title at all
        replay(Trace([Event(0, "forward", 0.0, 1.0), Event(1, "forward", 0.5, 1.5)], 2), frames=4).to_plotly_json(),
    ]
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("figs")
    cell.outputs = [nbformat.v4.new_output("display_data", data={figures.PLOTLY_MIME: s}) for s in specs]
    nb.cells = [nbformat.v4.new_markdown_cell("# 42 · test"), cell]
    nbformat.write(nb, tmp_path / "42_test.ipynb")
    rendered = []
    monkeypatch.setattr(figures, "static_renderer", lambda: None)
    monkeypatch.setattr(figures, "_write_static", lambda renders: rendered.extend(renders) or [])
    written, notes = figures.export("42", tmp_path / "out", ("html", "png"), folder=tmp_path)
    stems = sorted({p.stem for p in written if p.suffix == ".html" and p.stem.startswith("42_")})
    assert stems[0] == "42_fig01_one-step-of-1f1b-on-four-ranks-with-eight-micro-batches-measured-in-the-ranks"
    assert stems[1:3] == ["42_fig02_bytes-table", "42_fig03_lesson-42-figure-3-cell-1"]
    titles = [spec["layout"]["title"]["text"] for spec, _, _ in rendered]
    assert titles[2] == "Lesson 42, figure 3 (cell 1)" and all(titles)
    replayed = rendered[3][0]
    assert "frames" not in replayed and not {"updatemenus", "sliders"} & set(replayed["layout"])
    assert specs[3]["layout"]["sliders"] and specs[3]["frames"]  # the HTML page keeps them: it plays
    index = (tmp_path / "out" / "index.html").read_text()
    assert index.count("<img ") == 4 and 'src="42_fig02_bytes-table.png"' in index
