"""transformers' own model tests, run twice per model: as they are (baseline) and with
attnscore in place of ``"sdpa"`` (the ``sdpa_is_attnscore`` plugin beside this file);
then a table of both and of every test whose outcome differs.

    python tools/hf_suite/run.py --checkout PATH [--models llama,t5] [--out DIR]
    python tools/hf_suite/run.py --checkout PATH --table-only --out DIR   # from reports

``PATH`` is a transformers checkout (its ``tests/`` and ``src/``): the tests import the
checkout's own ``src/transformers`` (put first on ``PYTHONPATH``), so library and tests are
one version by construction; attnscore comes from this repository's ``src/``. Each run is
``python -m pytest tests/models/M/test_modeling_M.py -m "not slow" -p no:cacheprovider``
from the checkout's root, with a JUnit XML report read afterwards (``--out``, default
``hf_suite_results/``: one report per model and mode, ``differences.txt``, ``table.md``).
``--table-only`` runs nothing and makes the table from the reports already in ``--out``
(suites run in several sittings or processes, their reports gathered in one folder).
``nox -s hf_suite`` gets the checkout and the dependencies and runs this.

Exit status 0 when no test's outcome differs, 1 when some does, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

MODELS = ("llama", "mistral", "qwen2", "bert", "gpt2", "bart", "t5")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def checkout_version(checkout: Path) -> str:
    """``__version__`` of the checkout's ``src/transformers/__init__.py``."""
    text = (checkout / "src" / "transformers" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else "unknown"


def outcomes(report: Path) -> dict[str, str]:
    """Test id -> "passed", "failed" (failures and errors) or "skipped", from a JUnit XML
    report; empty if pytest wrote none."""
    if not report.exists():
        return {}
    result: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            result[name] = "failed"
        elif "skipped" in tags:
            result[name] = "skipped"
        else:
            result[name] = "passed"
    return result


def run_pytest(checkout: Path, model: str, mode: str, out: Path, extra: list[str]) -> Path:
    """One pytest run of ``model``'s modeling tests; returns its JUnit XML report."""
    test_file = checkout / "tests" / "models" / model / f"test_modeling_{model}.py"
    if not test_file.exists():
        raise SystemExit(f"hf_suite: {test_file} does not exist (is {checkout} a checkout?)")
    report = out / f"{model}-{mode}.xml"
    report.unlink(missing_ok=True)
    paths = [str(checkout / "src"), str(ROOT / "src")]
    plugin: list[str] = []
    if mode == "attnscore":
        paths.append(str(HERE))
        plugin = ["-p", "sdpa_is_attnscore"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    env.setdefault("HF_HUB_OFFLINE", "1")  # model tests build from configs; no downloads
    command = [
        sys.executable, "-m", "pytest", str(test_file.relative_to(checkout)),
        "-m", "not slow", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
        f"--junitxml={report}", *plugin, *extra,
    ]  # fmt: skip
    start = time.monotonic()
    with open(out / f"{model}-{mode}.log", "w", encoding="utf-8") as log:
        subprocess.run(command, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"{model:8} {mode:9} {time.monotonic() - start:7.0f} s", flush=True)
    return report


def table(rows: list[tuple[str, dict[str, str], dict[str, str]]], version: str) -> str:
    """The Markdown table: per suite, passed / failed of each run and the tests whose
    outcome differs."""
    lines = [
        f"transformers {version}, tests/models/<suite>/test_modeling_<suite>.py -m 'not slow'",
        "",
        "| suite | baseline passed | baseline failed | attnscore passed | attnscore failed "
        "| skipped (both) | outcome differs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    total = [0] * 6
    for model, base, ours in rows:
        differs = sum(base.get(t) != ours.get(t) for t in base.keys() | ours.keys())
        counts = [
            sum(o == "passed" for o in base.values()),
            sum(o == "failed" for o in base.values()),
            sum(o == "passed" for o in ours.values()),
            sum(o == "failed" for o in ours.values()),
            sum(base.get(t) == ours.get(t) == "skipped" for t in base),
            differs,
        ]
        total = [a + b for a, b in zip(total, counts, strict=True)]
        if not base or not ours:
            counts[-1] = -1
        lines.append(
            f"| {model} | " + " | ".join(map(str, counts)).replace("-1", "no report") + " |"
        )
    lines.append("| **total** | " + " | ".join(f"**{n}**" for n in total) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, required=True, help="a transformers checkout")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated suites")
    parser.add_argument("--out", type=Path, default=Path("hf_suite_results"))
    parser.add_argument(
        "--table-only", action="store_true", help="run nothing: the table of --out's reports"
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    if not (checkout / "tests" / "models").is_dir() or not (checkout / "src").is_dir():
        print(f"hf_suite: {checkout} is not a transformers checkout (tests/models, src/)")
        return 2
    models = [m for m in args.models.split(",") if m]
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    version = checkout_version(checkout)
    print(f"transformers {version} from {checkout}", flush=True)
    rows = []
    differences: list[str] = []
    for model in models:
        if args.table_only:
            base = outcomes(out / f"{model}-baseline.xml")
            ours = outcomes(out / f"{model}-attnscore.xml")
        else:
            base = outcomes(run_pytest(checkout, model, "baseline", out, args.pytest_args))
            ours = outcomes(run_pytest(checkout, model, "attnscore", out, args.pytest_args))
        rows.append((model, base, ours))
        for test in sorted(base.keys() | ours.keys()):
            if base.get(test) != ours.get(test):
                differences.append(f"{model}: {test}: {base.get(test)} -> {ours.get(test)}")
        text = table(rows, version)
        (out / "table.md").write_text(text, encoding="utf-8")
        (out / "differences.txt").write_text("\n".join(differences) + "\n", encoding="utf-8")
    print(text, end="")
    missing = [model for model, base, ours in rows if not base or not ours]
    for model in missing:
        print(f"{model}: a run wrote no report (collection failed?): see {out}/{model}-*.log")
    print("\n".join(differences) if differences else "no test's outcome differs")
    return 1 if differences or missing else 0


if __name__ == "__main__":
    sys.exit(main())
