"""MkDocs hook (mkdocs.yml ``hooks``): the table of policies on docs/policies.md, built
from the registry when the site is built, so it names every registered policy and
each of its knobs with its default and doc (``policies.knob_docs``), and the
summary that opens its module's docstring. A new policy is in it without a line
of docs; ``tests/docs/test_docs.py`` checks the rendered table."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = "<!-- policy-table -->"
SERVER_MARKER = "<!-- server-fields-table -->"


def _cell(text: str) -> str:
    """Docstring text as one Markdown table cell: ``code`` to `code`, no pipes or line breaks."""
    return re.sub(r"``([^`]+)``", r"`\1`", " ".join(text.split())).replace("|", "\\|")


def _default(value: object) -> str:
    """A knob's default as a workload file spells it."""
    if value is None:
        return "unset"
    return str(value).lower() if isinstance(value, bool) else str(value)


def policy_table() -> str:
    """The Markdown table: kind | what it is (its module docstring's first paragraph) | knobs."""
    from policies import POLICIES, knob_docs

    rows = ["| `policy.kind` | what it is | knobs (default): what each means |", "|---|---|---|"]
    for kind, (_, cls) in POLICIES.items():
        doc = importlib.import_module(cls.__module__).__doc__ or ""
        summary = _cell(doc.strip().split("\n\n")[0])
        knobs = "<br>".join(f"`{name}` ({_default(default)}): {_cell(text)}"
                            for name, default, text in knob_docs(kind))
        rows.append(f"| `{kind}` | {summary} | {knobs} |")
    return "\n".join(rows)


def server_fields_table() -> str:
    """The Markdown table of which ``server`` fields each policy reads, and for each one it
    does not, its own knob that means it (``Policy.server_knobs``)."""
    from policies import POLICIES
    from sim.run.config import ServerConfig
    from dataclasses import fields

    names = [f.name for f in fields(ServerConfig)]
    rows = ["| `policy.kind` | " + " | ".join(f"`server.{n}`" for n in names) + " |",
            "|---|" + "---|" * len(names)]
    for kind, (_, cls) in POLICIES.items():
        cells = []
        for name in names:
            if name not in cls.server_knobs:
                cells.append("read")
            else:
                knob, note = cls.server_knobs[name]
                cells.append((f"refused: `policy.{knob}`" if knob else "refused: none") + f" ({_cell(note)})")
        rows.append(f"| `{kind}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, policy_table())
    if SERVER_MARKER in markdown:
        markdown = markdown.replace(SERVER_MARKER, server_fields_table())
    return markdown
