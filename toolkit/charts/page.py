"""One chart = a matplotlib Figure + the tables of the numbers it plots, written as
NAME.png and NAME.html (the PNG embedded as base64: the page needs no other file).
Both appear together or not at all, and existing files are replaced only when asked."""
from __future__ import annotations

import base64
import html
import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..atomic import publish
from ..errors import OutputExistsError

SUFFIXES = (".png", ".html")


@dataclass(frozen=True)
class Table:
    caption: str
    header: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]


def chart_paths(out: str | Path) -> tuple[Path, Path]:
    """(PNG, HTML) for ``--out`` / ``--chart`` FILE: FILE's .png or .html suffix is replaced
    by both; any other name gets both appended."""
    p = Path(out)
    base = p.with_suffix("") if p.suffix in SUFFIXES else p
    return base.parent / (base.name + ".png"), base.parent / (base.name + ".html")


def check_chart_paths(out: str | Path, overwrite: bool) -> tuple[Path, Path]:
    paths = chart_paths(out)
    existing = [p for p in paths if p.exists()]
    if existing and not overwrite:
        raise OutputExistsError(f"output '{existing[0]}' already exists (pass --overwrite to replace it)")
    return paths


def _cell(v: object) -> str:
    """Numbers as a reader compares them: four significant digits (79.65 GiB, 0.4123, 1.5e-05),
    thousands grouped from 1,000 up (1,234,568 tokens/s); integers as they are."""
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return html.escape("-" if v is None else str(v))


def _table_html(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
    body = "\n".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in t.rows)
    return (f"<table>\n<caption>{html.escape(t.caption)}</caption>\n<thead><tr>{head}</tr></thead>\n"
            f"<tbody>\n{body}\n</tbody>\n</table>")


STYLE = ("body{font-family:sans-serif;margin:1.5em} img{max-width:100%} table{border-collapse:collapse;"
         "margin:1em 0;font-size:90%} td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
         " caption{font-weight:bold;text-align:left}")


def page_html(title: str, png: bytes, tables: list[Table]) -> str:
    img = base64.b64encode(png).decode("ascii")
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>",
             f"<style>{STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             f'<img alt="{html.escape(title)}" src="data:image/png;base64,{img}">',
             *(_table_html(t) for t in tables), "</body></html>\n"]
    return "\n".join(parts)


def _replace_together(files: dict[Path, bytes]) -> None:
    """Write each file to a temporary sibling, then rename them all into place."""
    tmps = {}
    try:
        for path, data in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            tmps[path] = Path(tmp)
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        raise
    for path, tmp in tmps.items():
        tmp.chmod(0o644)
        publish(tmp, path)


def write_chart(fig, tables: list[Table], out: str | Path, title: str, overwrite: bool = False) -> tuple[Path, Path]:
    """Render ``fig`` (a matplotlib Figure) and write NAME.png and NAME.html."""
    png_path, html_path = check_chart_paths(out, overwrite)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    png = buf.getvalue()
    _replace_together({png_path: png, html_path: page_html(title, png, tables).encode("utf-8")})
    return png_path, html_path
