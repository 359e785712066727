"""Sphinx configuration of the attnscore documentation site (``nox -s docs``).

Stack: Sphinx + furo + myst-nb. Sphinx's autodoc and napoleon read the Google-style
docstrings as they are (no second copy of the API to keep in step), myst-nb reads the
Markdown pages and executes the notebook at build time, and furo is a maintained, plain
theme. The build treats every warning as an error (``-W --keep-going``), including a
notebook cell that raises.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
SRC = DOCS.parent / "src"

# Document (and execute the notebook against) the checkout the docs live in, even when
# another copy of attnscore is installed, as the tests do (pyproject: pythonpath = src).
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(DOCS / "_ext"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]
)
# The notebook draws inline; a headless MPLBACKEND=Agg from CI would hide its figures.
os.environ.pop("MPLBACKEND", None)

import attnscore  # noqa: E402

project = "attnscore"
author = "attnscore developers"
copyright = "attnscore developers, MIT licence"
release = attnscore.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.intersphinx",
    "myst_nb",
    "sphinx-mathjax-offline",  # MathJax copied into the site: maths render offline
    "scorer_table",
    "site_checks",
]
# The package re-exports its public names; their source links go from the pages of the
# modules that define them (following the re-exports made viewcode's "[docs]" back-links
# point at anchors that do not exist: docs/_ext/anchors.py fails the build on those).
viewcode_follow_imported_members = False

exclude_patterns = ["_build", "jupyter_execute", ".jupyter_cache", "Thumbs.db", ".DS_Store"]
suppress_warnings = ["myst.header"]

# -- autodoc / napoleon: Google-style docstrings, signatures with types -------------------
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_inherit_docstrings = False  # never show nn.Module's generic text as ours
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

intersphinx_mapping: dict[str, tuple[str, str | None]] = {}

# -- MyST / myst-nb --------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "dollarmath", "amsmath"]
myst_heading_anchors = 3
# Execute the notebook on every build that sees it changed (cache keyed on its source);
# a cell error fails the build.
nb_execution_mode = "cache"
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 120
# The Keras notebook needs Keras, not torch: it is shown with its stored outputs here and
# executed in its own environment by .ci/run's `keras` step.
nb_execution_excludepatterns = ["keras.ipynb"]

# -- HTML -------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"attnscore {release}"
html_static_path: list[str] = []
