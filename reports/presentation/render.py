"""A tiny document model rendered twice: Markdown (images as files) and
self-contained HTML (images embedded as base64 PNG, no scripts, no network).

Blocks are plain dataclasses; ``write_document`` is the only writer.
"""

from __future__ import annotations

import base64
import html
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import pandas as pd

from sim.base.atomic import write_text_atomic


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Para:
    text: str                       # may hold `code` and **bold**


@dataclass(frozen=True)
class Bullets:
    items: list[str]


@dataclass(frozen=True)
class Callout:
    text: str
    kind: str = "warning"           # warning | note | ok (a recommendation)


@dataclass(frozen=True)
class Table:
    frame: pd.DataFrame
    caption: str = ""


@dataclass(frozen=True)
class Image:
    png: Path                       # the PNG on disk; an SVG twin may sit beside it
    caption: str


Block = Union[Heading, Para, Bullets, Callout, Table, Image]


@dataclass
class Document:
    title: str
    blocks: list[Block] = field(default_factory=list)

    def add(self, *blocks: Block) -> "Document":
        self.blocks.extend(blocks)
        return self


def fmt(value: Any) -> str:
    """Table cell text: integers plain, floats to 4 significant digits, missing as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return f"{int(value):,}"
        return f"{value:,.4g}" if abs(value) >= 1e-3 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _inline_html(text: str) -> str:
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def _md_cell(value: Any) -> str:
    return fmt(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(doc: Document, base_dir: Path) -> str:
    lines = [f"# {doc.title}", ""]
    for b in doc.blocks:
        if isinstance(b, Heading):
            lines += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Para):
            lines += [b.text, ""]
        elif isinstance(b, Bullets):
            lines += [f"- {item}" for item in b.items] + [""]
        elif isinstance(b, Callout):
            lines += [f"> **{_CALLOUT_LABELS.get(b.kind, b.kind)}:** {b.text}", ""]
        elif isinstance(b, Table):
            cols = [str(c) for c in b.frame.columns]
            if b.caption:
                lines += [f"*{b.caption}*", ""]
            lines.append("| " + " | ".join(cols) + " |")
            lines.append("|" + "|".join("---" for _ in cols) + "|")
            for row in b.frame.itertuples(index=False):
                lines.append("| " + " | ".join(_md_cell(v) for v in row) + " |")
            lines.append("")
        elif isinstance(b, Image):
            rel = os.path.relpath(b.png, base_dir)
            svg = b.png.with_suffix(".svg")
            extra = f" ([SVG]({os.path.relpath(svg, base_dir)}))" if svg.exists() else ""
            lines += [f"![{b.caption}]({rel})", "", f"*{b.caption}*{extra}", ""]
    return "\n".join(lines).rstrip() + "\n"


_CALLOUT_LABELS = {"warning": "Warning", "note": "Note", "ok": "Recommended"}

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{border-bottom:2px solid #ddd;padding-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #eee}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.88em}th,td{border:1px solid #ccc;padding:3px 7px;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
caption{caption-side:top;text-align:left;font-style:italic;padding-bottom:.3em}
figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}figcaption{font-style:italic;color:#555}
.callout{padding:.6em 1em;border-left:5px solid;margin:1em 0}.warning{background:#fff6e5;border-color:#f0a000}
.note{background:#eef5ff;border-color:#3b82f6}.ok{background:#ecfdf3;border-color:#16a34a}
code{background:#f4f4f4;padding:0 3px}
"""


def to_html(doc: Document) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{html.escape(doc.title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
             f"<h1>{html.escape(doc.title)}</h1>"]
    for b in doc.blocks:
        if isinstance(b, Heading):
            parts.append(f"<h{b.level}>{html.escape(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            parts.append(f"<p>{_inline_html(b.text)}</p>")
        elif isinstance(b, Bullets):
            parts.append("<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Callout):
            parts.append(f'<div class="callout {b.kind}"><strong>{_CALLOUT_LABELS.get(b.kind, b.kind)}:</strong> '
                         f"{_inline_html(b.text)}</div>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{html.escape(str(c))}</th>" for c in b.frame.columns)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(v))}</td>" for v in row) + "</tr>"
                           for row in b.frame.itertuples(index=False))
            cap = f"<caption>{html.escape(b.caption)}</caption>" if b.caption else ""
            parts.append(f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif isinstance(b, Image):
            data = base64.b64encode(b.png.read_bytes()).decode("ascii")
            parts.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(b.caption)}">'
                         f"<figcaption>{html.escape(b.caption)}</figcaption></figure>")
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def write_document(doc: Document, out_dir: Path, stem: str = "report") -> list[Path]:
    """Write ``stem.md`` and ``stem.html`` into ``out_dir`` atomically; return both paths."""
    return [write_text_atomic(out_dir / f"{stem}.md", to_markdown(doc, out_dir)),
            write_text_atomic(out_dir / f"{stem}.html", to_html(doc))]
