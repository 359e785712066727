"""Fail the build on a site that is broken where Sphinx does not look.

After the HTML is written:

- every relative ``page.html#anchor`` link is checked against the ids that page defines
  (Sphinx checks cross-references while it resolves them, but not links extensions write
  straight into HTML: viewcode's "[docs]" back-links were 12 links to missing anchors);
- no page loads a script from another site (MathJax from a CDN left an offline build
  showing raw LaTeX).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the checks themselves need no Sphinx (the tests import them without)
    from sphinx.application import Sphinx

_LINK = re.compile(r'href="([^"#:?]*\.html)#([^"]+)"')
_ID = re.compile(r'\bid="([^"]+)"')
_REMOTE_SCRIPT = re.compile(r'<script[^>]*\bsrc="((?:https?:)?//[^"]+)"')


def broken_anchors(outdir: Path) -> list[str]:
    """``"page -> target#anchor"`` for each relative link whose anchor its target lacks."""
    pages = {p.resolve(): p.read_text(errors="replace") for p in outdir.rglob("*.html")}
    ids = {page: set(_ID.findall(text)) for page, text in pages.items()}
    broken = []
    for page, text in pages.items():
        for href, anchor in _LINK.findall(text):
            target = (page.parent / href).resolve()
            if target in ids and anchor not in ids[target]:
                broken.append(f"{page.relative_to(outdir.resolve())} -> {href}#{anchor}")
    return sorted(set(broken))


def remote_scripts(outdir: Path) -> list[str]:
    """``"page: url"`` for each script a page loads from another site."""
    found = []
    for page in outdir.rglob("*.html"):
        for url in _REMOTE_SCRIPT.findall(page.read_text(errors="replace")):
            found.append(f"{page.relative_to(outdir)}: {url}")
    return sorted(set(found))


def _check(app: Sphinx, exception: Exception | None) -> None:
    from sphinx.errors import ExtensionError

    if exception is not None or app.builder.format != "html":
        return
    outdir = Path(app.outdir)
    broken = broken_anchors(outdir)
    if broken:
        raise ExtensionError(f"{len(broken)} link(s) to missing anchors: {broken}")
    remote = remote_scripts(outdir)
    if remote:
        raise ExtensionError(f"{len(remote)} script(s) loaded from other sites: {remote[:5]}")


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("build-finished", _check)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
