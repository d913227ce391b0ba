"""`toolkit report` and `toolkit plan --chart`: the PNG is a valid image, the HTML page is
self-contained (the same PNG inline) and carries the plotted numbers in its tables."""
import base64
import json
from html.parser import HTMLParser

import pytest

from toolkit.cli import main
from toolkit.plan import load_plan

from tests.conftest import ROOT

SEED = str(ROOT / "examples/llama70b_1024gpu.yaml")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Page(HTMLParser):
    """The <img> sources and every table cell of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.images, self.cells, self._in_cell = [], [], False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        self._in_cell = tag in ("td", "th")

    def handle_data(self, data):
        if self._in_cell:
            self.cells.append(data)

    def handle_endtag(self, tag):
        self._in_cell = False


def check_pair(png_path, html_path) -> Page:
    """Both files exist; the PNG decodes; the page embeds exactly that PNG."""
    from matplotlib.image import imread

    png = png_path.read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    height, width, _ = imread(png_path).shape
    assert width > 400 and height > 300
    page = Page(html_path.read_text())
    assert page.images == ["data:image/png;base64," + base64.b64encode(png).decode()]
    return page


def shown(v: float) -> str:
    """A number as the pages print it: four significant digits, thousands grouped from 1,000."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def test_page_numbers_are_rounded_for_reading():
    """Issue 37: the tables printed 79.6475 (GiB) and 1234567.8 (tokens/s) as they came."""
    from toolkit.charts.page import Table, page_html

    html = page_html("t", b"", [Table("c", ("a",), ((79.6475,), (1234567.8,), (0.41234,), (1.5e-05,), (3,), (None,)))])
    assert Page(html).cells[-6:] == ["79.65", "1,234,568", "0.4123", "1.5e-05", "3", "-"]


def covered_by_legends(fig) -> list[str]:
    """Which axes a legend overlaps, or which legend leaves the figure (drawn as the PNG is)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    r = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    assert legends
    found = []
    for i, leg in enumerate(legends):
        box = leg.get_window_extent(r)
        found += [f"legend {i} over axes '{ax.get_title() or ax.get_ylabel()}'" for ax in fig.axes
                  if box.overlaps(ax.get_window_extent(r))]
        if not (fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1):
            found.append(f"legend {i} outside the figure")
    return found


def test_legends_cover_no_bars_or_lines(tmp_path):
    """Issue 37: the legends sat over the bars of --chart and --auto --chart, and over a curve of
    the report. Each now sits outside every plotting area (the bars, lines and totals live
    there), inside the figure."""
    from toolkit.charts.plans import plan_figure
    from toolkit.charts.runs import read_run, runs_figure
    from toolkit.search.search import search

    plan = load_plan(SEED)
    assert covered_by_legends(plan_figure([("spec", plan)])) == []
    top = search(plan.spec, top=3).candidates
    assert covered_by_legends(plan_figure([(f"#{i}", c.plan) for i, c in enumerate(top, 1)])) == []
    write_run(tmp_path / "a", [4.25, 3.5, 3.125])
    write_run(tmp_path / "b", [3.0625, 2.875], start=4)
    assert covered_by_legends(runs_figure([read_run(tmp_path / "a"), read_run(tmp_path / "b")])) == []


def write_run(folder, losses, start=1):
    folder.mkdir()
    rows = [{"step": s, "loss": loss, "lr": 1e-3 * s, "grad_norm": None if s == start else 0.5 + s / 10,
             "tokens_per_s": 1000.0 + s, "step_time_s": 0.25} for s, loss in enumerate(losses, start)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_report_draws_runs_on_shared_axes_with_their_numbers(tmp_path, capsys):
    a = write_run(tmp_path / "a", [4.25, 3.5, 3.125])
    b = write_run(tmp_path / "b", [3.0625, 2.875], start=4)  # a resumed run
    out = tmp_path / "out" / "report.html"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    page = check_pair(out.with_suffix(".png"), out)
    for row in a + b:
        assert shown(row["loss"]) in page.cells and shown(row["tokens_per_s"]) in page.cells
    assert shown(a[-1]["lr"]) in page.cells
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a"), "--out", str(out)]) == 1  # exists: not replaced unasked
    assert "already exists" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "a"), "--out", str(out), "--overwrite"]) == 0
    assert main(["report", str(tmp_path / "none"), "--out", str(tmp_path / "x.png")]) == 3
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.html").exists()


def test_report_without_out_writes_beside_the_runs(tmp_path, monkeypatch, capsys):
    """One run: RUN_DIR/report.png and .html; several: report-A-vs-B in the folder they share."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    write_run(tmp_path / "runs" / "a", [4.25, 3.5])
    write_run(tmp_path / "runs" / "b", [4.0, 3.0])
    assert main(["report", "runs/a"]) == 0
    assert capsys.readouterr().out == "wrote runs/a/report.png and runs/a/report.html\n"
    check_pair(tmp_path / "runs/a/report.png", tmp_path / "runs/a/report.html")
    assert main(["report", "runs/a", "runs/b"]) == 0
    assert capsys.readouterr().out == "wrote runs/report-a-vs-b.png and runs/report-a-vs-b.html\n"
    assert main(["report", "runs/a", "runs/b"]) == 1  # the default path is refused as any other


def test_plan_chart_per_stage_memory_and_step_time(tmp_path):
    assert main(["plan", SEED, "--chart", str(tmp_path / "plan.png")]) == 0
    page = check_pair(tmp_path / "plan.png", tmp_path / "plan.html")
    plan = load_plan(SEED)
    for stage in plan.memory.stages:
        gib = stage.gib()
        assert shown(gib["activations"]) in page.cells and shown(gib["total"]) in page.cells
    for seconds in plan.time.terms.values():
        assert shown(seconds) in page.cells
    # one row per stage, per cause of step time, and the step summary
    assert sum(cell.startswith("tp8 pp8") for cell in page.cells) == len(plan.memory.stages) + len(plan.time.terms) + 1


def test_auto_chart_top_candidates_side_by_side(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text("model: llama3-8b\ncluster: {nodes: 1, gpus_per_node: 8, gpu: h100-80gb}\n"
                    "batch: {global: 64, seq_len: 4096}\n")
    assert main(["plan", str(spec), "--auto", "--top", "3", "--json", "--chart", str(tmp_path / "auto")]) == 0
    top = json.loads(capsys.readouterr().out)["candidates"]
    page = check_pair(tmp_path / "auto.png", tmp_path / "auto.html")
    for i, cand in enumerate(top, 1):
        assert any(c.startswith(f"#{i}\n") for c in page.cells)
        assert shown(cand["step_time_s"]) in page.cells


def test_no_chart_from_sizes_that_do_not_come_out(tmp_path, capsys):
    assert main(["plan", SEED, "--set", "parallel.tp=3", "--chart", str(tmp_path / "c")]) == 2
    assert "no chart" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("given, png, html", [("r.html", "r.png", "r.html"), ("r.png", "r.png", "r.html"),
                                              ("r", "r.png", "r.html"), ("r.v2", "r.v2.png", "r.v2.html")])
def test_chart_file_names(given, png, html):
    from toolkit.charts import chart_paths

    assert tuple(p.name for p in chart_paths(given)) == (png, html)


def test_report_shows_the_validation_loss(tmp_path, capsys):
    """train.eval_interval: the loss panel gets a dashed validation curve per run that has one,
    and the run's table a valid_loss column."""
    from toolkit.charts.runs import read_run, runs_figure

    rows = write_run(tmp_path / "a", [4.25, 3.5, 3.125, 3.0])
    rows[1]["valid_loss"], rows[3]["valid_loss"] = 3.8125, 3.3125
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_run(tmp_path / "b", [3.0625, 2.875])
    loss_panel = runs_figure([read_run(tmp_path / "a"), read_run(tmp_path / "b")]).axes[0]
    dashed = [ln for ln in loss_panel.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == 1 and list(dashed[0].get_xdata()) == [2, 4] and list(dashed[0].get_ydata()) == [3.8125, 3.3125]
    out = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    page = check_pair(out.with_suffix(".png"), out)
    assert page.cells.count("valid_loss") == 1 and "3.812" in page.cells and "3.312" in page.cells
