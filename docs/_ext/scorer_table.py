"""``{scorer-table}``: the table of registered scorers, read from attnscore.registry.SCORERS.

The table is generated at build time, so it cannot drift from the registry: a scorer
registered in the code appears in the documentation with its formula and source.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def _cell(text: str, *, literal: bool = False) -> nodes.entry:
    inline: nodes.Node = nodes.literal(text, text) if literal else nodes.Text(text)
    return nodes.entry("", nodes.paragraph("", "", inline))


class ScorerTable(SphinxDirective):
    """A table with one row per registered scorer: name, score a(q, k), q = k?, source."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from attnscore.registry import SCORERS

        header = ["name", "score a(q, k)", "queries and keys of one size d", "source"]
        table = nodes.table(classes=["scorer-table"])
        group = nodes.tgroup(cols=len(header))
        table += group
        for width in (14, 30, 14, 42):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        head += nodes.row("", *(_cell(h) for h in header))
        group += head
        body = nodes.tbody()
        for name in sorted(SCORERS):
            spec = SCORERS[name]
            same = "yes" if spec.same_feature_size else "no"
            body += nodes.row(
                "",
                _cell(name, literal=True),
                _cell(spec.formula),
                _cell(same),
                _cell(spec.source),
            )
        group += body
        return [table]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("scorer-table", ScorerTable)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
