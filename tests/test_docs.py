"""The docs cannot drift: README's figures are generated from the committed bench result, and README stays a guide.

``scripts/docs_figures.py`` regenerates the figure blocks of README.md and docs/PERFORMANCE.md from
``docs/bench/*.txt``; these tests run its ``--check`` on the checkout and on a copy whose block was edited
by hand. No bench runs here and nothing reaches the network.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "docs_figures.py"
#: The guide's length limit: the reference material lives in docs/.
README_MAX_LINES = 400
#: A performance figure in prose: a ratio, a rate, a size in MB, a duration or a share.
PERFORMANCE_FIGURE = re.compile(
    r"\d[\d.,]*\s*(?:×(?!\s*\d)|x\b|GB/s|MB\b|MiB\b|GiB\b|s\b|min\b|minutes?\b|seconds?\b|%)"
)


def _figures() -> ModuleType:
    """scripts/docs_figures.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("docs_figures", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_figures", module)
    spec.loader.exec_module(module)
    return module


def _copy_of_the_docs(tmp_path: Path) -> Path:
    """The files the script reads, copied under ``tmp_path`` as a checkout of their own."""
    for document in _figures().DOCUMENTS:
        (tmp_path / document).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / document, tmp_path / document)
    shutil.copytree(REPO / "docs" / "bench", tmp_path / "docs" / "bench")
    return tmp_path


def test_check_passes_on_the_repository() -> None:
    """README's and docs/PERFORMANCE.md's figure blocks are what the committed result files give."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    readme = (REPO / "README.md").read_text()
    assert "<!-- figures:quick -->" in readme, "README no longer shows the committed bench run"


def test_a_figure_edited_by_hand_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One number changed inside README's block: ``--check`` exits 1 naming the block; regenerating restores it."""
    figures = _figures()
    root = _copy_of_the_docs(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    block = text[text.index("<!-- figures:quick -->") : text.index("<!-- /figures -->")]
    headline = next(line for line in block.splitlines() if line.startswith("export_vs_reference="))
    edited = headline.replace("export_vs_reference=", "export_vs_reference=0", 1)
    readme.write_text(text.replace(headline, edited))

    assert figures.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "README.md: block figures:quick differs from docs/bench/quick.txt; run: python scripts/docs_figures.py"
    ]
    assert readme.read_text() != text, "--check must not write"

    assert figures.main(["--root", str(root)]) == 0
    assert readme.read_text() == text
    assert figures.main(["--check", "--root", str(root)]) == 0


def test_a_result_shown_nowhere_or_unreadable_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """README without the block fails the check (the file is shown nowhere); a header without its commit is refused."""
    figures = _figures()
    root = _copy_of_the_docs(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    start, end = text.index("<!-- figures:quick -->"), text.index("<!-- /figures -->") + len("<!-- /figures -->")
    readme.write_text(text[:start] + text[end:])
    assert figures.main(["--check", "--root", str(root)]) == 1
    assert "docs/bench/quick.txt: shown by no block of README.md" in capsys.readouterr().err

    readme.write_text(text)
    result = root / "docs" / "bench" / "quick.txt"
    result.write_text("".join(line for line in result.read_text().splitlines(True) if not line.startswith("# commit")))
    assert figures.main(["--check", "--root", str(root)]) == 2
    assert "the header lacks commit" in capsys.readouterr().err


def test_readme_is_a_guide_of_at_most_400_lines() -> None:
    """The reference material lives in docs/; README is the user's guide."""
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_readme_quotes_no_performance_figure_outside_a_generated_block() -> None:
    """Every speed, memory or time figure README quotes comes from a committed result, through a block."""
    text = (REPO / "README.md").read_text()
    prose = re.sub(r"<!-- figures:.*?<!-- /figures -->", "", text, flags=re.DOTALL)
    found = [m.group() for m in PERFORMANCE_FIGURE.finditer(prose)]
    assert found == [], f"figures typed by hand in README.md: {found}"


def test_readme_keeps_the_two_commands_ci_runs() -> None:
    """.ci/run runs the README's test command; README keeps both commands as they are."""
    readme = (REPO / "README.md").read_text()
    assert "make demo   #" in readme and "make test   #" in readme
    assert re.search(r"^make test$", (REPO / ".ci" / "run").read_text(), flags=re.MULTILINE)


def test_readme_and_docs_links_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file that is there (the moved sections included)."""
    broken = []
    for document in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text()):
            if "://" not in target and not (document.parent / target).exists():
                broken.append(f"{document.relative_to(REPO)}: {target}")
    assert broken == []
