#!/usr/bin/env python
"""Regenerate the benchmark figures of README.md and docs/PERFORMANCE.md from the committed bench results.

Figures in the docs are never typed by hand: each one sits in a generated block between two marker lines,

    <!-- figures:NAME -->        the summary: the table, the target lines and the key=value line
    <!-- figures:NAME full -->   the whole report: the table, then every other line the bench printed
    <!-- /figures -->

and the block's content is made from ``docs/bench/NAME.txt``, a committed run of the bench: a header of
``# key: value`` lines (``date``, ``command`` and ``commit`` required: when it ran, the command as run,
the commit it ran on; ``machine`` optional), then what the command printed on stdout, verbatim, whose
last line is the bench's ``key=value`` line. Every result file must be shown by a block of README.md.

    python scripts/docs_figures.py            rewrite every block from its result file
    python scripts/docs_figures.py --check    exit 1, one line per block, if any block differs; else 0

To refresh a figure: run the command in the file's header, replace the file (header with the new date
and commit, then the output), run this script, commit both. Standard library only (it runs with any
Python 3.12). Exit status: 0 done (or every block up to date), 1 a block differs (``--check``) or a
result file is shown by no README block, 2 a file this script cannot read as described above.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: The checkout this script belongs to.
ROOT = Path(__file__).resolve().parent.parent
#: The documents whose figure blocks are generated, relative to the checkout.
DOCUMENTS = ("README.md", "docs/PERFORMANCE.md")
#: The user's guide: every committed result is shown there.
GUIDE = "README.md"
#: Where the committed bench results live: ``NAME.txt`` feeds the blocks ``figures:NAME``.
RESULTS = "docs/bench"
#: Header keys every result file carries.
REQUIRED_KEYS = ("date", "command", "commit")
OPEN = re.compile(r"<!-- figures:(?P<name>[a-z0-9][a-z0-9-]*)(?: (?P<style>full))? -->")
CLOSE = "<!-- /figures -->"
#: The bench's last line: ``export_vs_reference=1.516 import_vs_reference=1.684 ...``.
KEY_VALUE_LINE = re.compile(r"\w+=\S+(?: \w+=\S+)*")


class FiguresError(Exception):
    """A result file or a document this script cannot read as its docstring describes (exit 2)."""


@dataclass(frozen=True)
class BenchResult:
    """One committed bench run: its header and what the command printed."""

    name: str
    path: str  # relative to the checkout, with forward slashes
    header: dict[str, str]
    report: tuple[str, ...]

    @property
    def table(self) -> list[str]:
        """The report's Markdown table: its header, separator and one row per measured step."""
        return [line for line in self.report if line.startswith("|")]

    @property
    def after_table(self) -> list[str]:
        """Every line after the table (phases, targets, the key=value line), outer blank lines dropped."""
        last = max(i for i, line in enumerate(self.report) if line.startswith("|"))
        rest = list(self.report[last + 1 :])
        while rest and not rest[0].strip():
            rest.pop(0)
        return rest

    @property
    def summary(self) -> list[str]:
        """The target lines and, last, the key=value line."""
        return [line for line in self.report if line.startswith("target ")] + [self.report[-1]]


def read_result(root: Path, name: str) -> BenchResult:
    """Parse ``docs/bench/NAME.txt`` under ``root``; :class:`FiguresError` names what is wrong with it."""
    relative = f"{RESULTS}/{name}.txt"
    path = root / relative
    if not path.is_file():
        raise FiguresError(f"{relative}: no such result file (the block figures:{name} reads it)")
    lines = path.read_text(encoding="utf-8").splitlines()
    header: dict[str, str] = {}
    start = 0
    while start < len(lines) and lines[start].startswith("#"):
        key, colon, value = lines[start].removeprefix("#").strip().partition(":")
        if not colon or not key.strip() or not value.strip():
            raise FiguresError(f"{relative}:{start + 1}: a header line is '# key: value', not {lines[start]!r}")
        header[key.strip()] = value.strip()
        start += 1
    missing = [key for key in REQUIRED_KEYS if key not in header]
    if missing:
        raise FiguresError(f"{relative}: the header lacks {', '.join(missing)} (it needs {', '.join(REQUIRED_KEYS)})")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}\S*", header["date"]):
        raise FiguresError(f"{relative}: date {header['date']!r} is not an ISO date (YYYY-MM-DD...)")
    if not re.fullmatch(r"[0-9a-f]{7,40}", header["commit"]):
        raise FiguresError(f"{relative}: commit {header['commit']!r} is not a git commit hash")
    report = lines[start:]
    while report and not report[-1].strip():
        report.pop()
    if not any(line.startswith("|") for line in report):
        raise FiguresError(f"{relative}: no table rows after the header (is it the bench's output?)")
    if not KEY_VALUE_LINE.fullmatch(report[-1]):
        raise FiguresError(f"{relative}: the last line is not the bench's key=value line: {report[-1]!r}")
    return BenchResult(name=name, path=relative, header=header, report=tuple(report))


def render(result: BenchResult, full: bool, document: str) -> list[str]:
    """The lines between a block's markers: where the figures come from, the table, then the text lines."""
    link = Path(os.path.relpath(result.path, Path(document).parent)).as_posix()
    header = result.header
    machine = f" on {header['machine']}" if header.get("machine") else ""
    return [
        f"<!-- generated from {result.path} by scripts/docs_figures.py: edit that file, not this block -->",
        f"`{header['command']}`, run {header['date']} at commit {header['commit'][:12]}{machine}; "
        f"its output: [{result.path}]({link}).",
        "",
        *result.table,
        "",
        "```text",
        *(result.after_table if full else result.summary),
        "```",
    ]


def regenerate(text: str, document: str, load: Callable[[str], BenchResult]) -> tuple[str, list[str], set[str]]:
    """``text`` with every figure block rebuilt, the labels of the blocks that changed, and the result names used.

    ``document`` is the text's path relative to the checkout (for links and messages); ``load`` gives the
    parsed result file of a block's name.
    """
    lines = text.split("\n")
    out: list[str] = []
    changed: list[str] = []
    used: set[str] = set()
    i = 0
    while i < len(lines):
        opening = OPEN.fullmatch(lines[i].strip())
        if opening is None:
            if lines[i].strip() == CLOSE:
                raise FiguresError(f"{document}:{i + 1}: {CLOSE} without an opening <!-- figures:NAME -->")
            out.append(lines[i])
            i += 1
            continue
        name, full = opening["name"], opening["style"] == "full"
        label = f"figures:{name}" + (" full" if full else "")
        end = i + 1
        while end < len(lines) and lines[end].strip() != CLOSE:
            if OPEN.fullmatch(lines[end].strip()):
                raise FiguresError(f"{document}:{i + 1}: block {label} is not closed before the next block opens")
            end += 1
        if end == len(lines):
            raise FiguresError(f"{document}:{i + 1}: block {label} is not closed by {CLOSE}")
        fresh = render(load(name), full, document)
        if lines[i + 1 : end] != fresh:
            changed.append(label)
        used.add(name)
        out += [lines[i], *fresh, lines[end]]
        i = end + 1
    return "\n".join(out), changed, used


def process(root: Path, write: bool) -> tuple[list[str], list[str]]:
    """Regenerate (``write``) or compare every document's blocks under ``root``.

    Returns one message per problem (a block that differs, when not writing; a result file no README
    block shows) and the documents rewritten.
    """
    results: dict[str, BenchResult] = {}

    def load(name: str) -> BenchResult:
        if name not in results:
            results[name] = read_result(root, name)
        return results[name]

    problems: list[str] = []
    rewritten: list[str] = []
    shown_in_guide: set[str] = set()
    for document in DOCUMENTS:
        path = root / document
        if not path.is_file():
            raise FiguresError(f"{document}: no such document")
        text = path.read_text(encoding="utf-8")
        fresh, changed, used = regenerate(text, document, load)
        if document == GUIDE:
            shown_in_guide = used
        if write and fresh != text:
            path.write_text(fresh, encoding="utf-8")
            rewritten.append(document)
        elif not write:
            problems += [
                f"{document}: block {label} differs from {RESULTS}/{label.split()[0].removeprefix('figures:')}.txt; "
                "run: python scripts/docs_figures.py"
                for label in changed
            ]
    committed = sorted(p.stem for p in (root / RESULTS).glob("*.txt")) if (root / RESULTS).is_dir() else []
    problems += [
        f"{RESULTS}/{name}.txt: shown by no block of {GUIDE} (add <!-- figures:{name} --> ... {CLOSE})"
        for name in committed
        if name not in shown_in_guide
    ]
    return problems, rewritten


def main(argv: list[str] | None = None) -> int:
    """The command line: rewrite the blocks, or with ``--check`` say which differ (exit status in the docstring)."""
    parser = argparse.ArgumentParser(
        prog="docs_figures.py",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 with one line per block that differs from its result file",
    )
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the checkout to work on (default: the one holding this script)"
    )
    args = parser.parse_args(argv)
    try:
        problems, rewritten = process(args.root, write=not args.check)
    except FiguresError as error:
        print(f"docs_figures.py: error: {error}", file=sys.stderr)
        return 2
    for document in rewritten:
        print(f"docs_figures.py: rewrote the figure blocks of {document}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
