"""`toolkit report` and `toolkit plan --chart`: the PNG is a valid image, the HTML page is
self-contained (the same PNG inline) and carries the plotted numbers in its tables."""
import base64
import json
from html.parser import HTMLParser

import pytest

from toolkit.cli import main
from toolkit.plan import load_plan

from .conftest import ROOT

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
        assert f"{row['loss']:.6g}" in page.cells and f"{row['tokens_per_s']:.6g}" in page.cells
    assert f"{a[-1]['lr']:.6g}" in page.cells
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a"), "--out", str(out)]) == 1  # exists: not replaced unasked
    assert "already exists" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "a"), "--out", str(out), "--overwrite"]) == 0
    assert main(["report", str(tmp_path / "none"), "--out", str(tmp_path / "x.png")]) == 3
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.html").exists()


def test_plan_chart_per_stage_memory_and_step_time(tmp_path):
    assert main(["plan", SEED, "--chart", str(tmp_path / "plan.png")]) == 0
    page = check_pair(tmp_path / "plan.png", tmp_path / "plan.html")
    plan = load_plan(SEED)
    for stage in plan.memory.stages:
        gib = stage.gib()
        assert f"{gib['activations']:.6g}" in page.cells and f"{gib['total']:.6g}" in page.cells
    for seconds in plan.time.terms.values():
        assert f"{seconds:.6g}" in page.cells
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
        assert f"{cand['step_time_s']:.6g}" in page.cells


def test_no_chart_from_sizes_that_do_not_come_out(tmp_path, capsys):
    assert main(["plan", SEED, "--set", "parallel.tp=3", "--chart", str(tmp_path / "c")]) == 2
    assert "no chart" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("given, png, html", [("r.html", "r.png", "r.html"), ("r.png", "r.png", "r.html"),
                                              ("r", "r.png", "r.html"), ("r.v2", "r.v2.png", "r.v2.html")])
def test_chart_file_names(given, png, html):
    from toolkit.charts import chart_paths

    assert tuple(p.name for p in chart_paths(given)) == (png, html)
