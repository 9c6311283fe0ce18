"""The README stays short and correct, and the documentation site builds (issue 35).

`mkdocs build --strict` fails on a broken link, an unknown anchor, a page missing from the
nav and a nav entry without a page (mkdocs.yml ``validation``); the API reference pages
are rendered from the docstrings by mkdocstrings in the same build. The README's and the
quick start's shell and Python blocks must parse, so a copied command is at least a
command.
"""

from __future__ import annotations

import ast
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_specx.methods import METHODS, defaults_table_markdown

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
# The pages whose every code block a newcomer copies: each block names its language.
COPIED = [README, ROOT / "docs" / "quickstart.md"]
# Pages whose shell blocks hold placeholders to fill in before they parse
# (ascend.md: `export MODEL=<local path ...>`); their Python blocks are still checked.
SHELL_PLACEHOLDER_PAGES = {"ascend.md"}
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
SHELL = {"bash", "sh", "shell", "console"}


def _blocks(path: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text(encoding="utf-8"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # CPU seconds, not wall clock: the test machine is shared, the build's own work is not.
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 30, f"mkdocs build took {cpu_s:.1f} CPU seconds (the aim: < 30)"
    return out


def test_mkdocs_build_strict_passes(site: Path) -> None:
    assert (site / "index.html").is_file()
    # Every page of docs/ became a page of the site (strict mode refuses unlisted pages).
    for page in (ROOT / "docs").rglob("*.md"):
        rel = page.relative_to(ROOT / "docs").with_suffix("")
        # use_directory_urls: a/index.md -> a/index.html, a/b.md -> a/b/index.html
        built = site / (rel.parent if rel.name == "index" else rel) / "index.html"
        assert built.is_file(), f"{page} was not built ({built})"


def test_api_reference_is_rendered_from_the_docstrings(site: Path) -> None:
    algorithms = (site / "api" / "algorithms" / "index.html").read_text(encoding="utf-8")
    assert "VerifyBatch" in algorithms and "largest_passing_depth" in algorithms
    methods = (site / "api" / "methods" / "index.html").read_text(encoding="utf-8")
    assert "MethodSpec" in methods and "defaults_table_markdown" in methods
    config = (site / "api" / "config" / "index.html").read_text(encoding="utf-8")
    assert "SpecxConfigError" in config
    # Sphinx roles in the docstrings are stripped (scripts/mkdocs_hooks.py).
    assert ":class:" not in algorithms


def test_knobs_page_shows_the_generated_table(site: Path) -> None:
    html = (site / "methods" / "knobs" / "index.html").read_text(encoding="utf-8")
    assert "acceptance_threshold" in html and "confidence_signal" in html
    assert "<table>" in html and defaults_table_markdown().count("\n") > 10


def test_readme_is_at_most_200_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_names_the_test_command_and_the_docs() -> None:
    text = README.read_text(encoding="utf-8")
    assert "bash scripts/test.sh" in text and "`.ci/run` calls `bash scripts/test.sh`." in text
    assert "bash scripts/bench.sh" in text
    assert "mkdocs serve" in text
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/test.sh" in ci


def test_readme_lists_every_method() -> None:
    text = README.read_text(encoding="utf-8")
    table = [line for line in text.splitlines() if line.startswith("| `")]
    for name in METHODS:
        assert any(f"`{name}`" in row for row in table), f"method {name} missing from README"


def test_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links no documentation page"
    for link in local:
        assert (ROOT / link).exists(), f"README.md links {link}, which does not exist"


def _check_blocks(path: Path, blocks: list[tuple[str, str]], shell: bool = True) -> None:
    for lang, code in blocks:
        if lang in SHELL and shell:
            proc = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True,
                                  timeout=30)
            assert proc.returncode == 0, f"{path.name}: bash -n fails:\n{code}\n{proc.stderr}"
        elif lang == "python":
            compile(code, f"{path.name} block", "exec")
            ast.parse(code)
        elif lang == "json":
            json.loads(code)


@pytest.mark.parametrize("path", COPIED, ids=lambda p: p.name)
def test_readme_and_quick_start_blocks_parse(path: Path) -> None:
    blocks = _blocks(path)
    assert any(lang in SHELL for lang, _ in blocks) and any(lang == "python" for lang, _ in blocks)
    for lang, code in blocks:
        assert lang, f"{path.name}: a code block without a language:\n{code}"
    _check_blocks(path, blocks)


def test_every_docs_page_shell_and_python_block_parses() -> None:
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert len(pages) > 20
    for page in pages:
        _check_blocks(page, _blocks(page), shell=page.name not in SHELL_PLACEHOLDER_PAGES)


def test_block_checks_catch_a_broken_block(tmp_path: Path) -> None:
    # The checks above would pass vacuously if the fence pattern found nothing to check.
    page = tmp_path / "page.md"
    page.write_text("x\n\n```bash\nif true; then echo\n```\n\n```python\ndef f(:\n```\n")
    (shell, bad_sh), (py, bad_py) = _blocks(page)
    assert (shell, py) == ("bash", "python")
    assert subprocess.run(["bash", "-n"], input=bad_sh, capture_output=True,
                          text=True).returncode != 0
    with pytest.raises(SyntaxError):
        compile(bad_py, "block", "exec")


def _plot_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plot_real_pair
    finally:
        sys.path.pop(0)
    return plot_real_pair


def test_real_pair_plots_show_the_pages_tables() -> None:
    plots = _plot_module()
    rows = plots.read_tables(plots.PAGE.read_text(encoding="utf-8"))
    # Both result tables, every (batch, T) of the draft-model run, the headline row.
    assert {r.table for r in rows} == {0, 1}
    assert {(r.batch, r.temperature) for r in rows} == {(1, 0), (1, 1), (8, 0), (8, 1)}
    eagle = [r for r in rows if r.table == 1 and r.config.startswith("eagle3")
             and (r.batch, r.temperature) == (1, 0)]
    assert len(eagle) == 1 and eagle[0].cpu_speedup == 1.12 and eagle[0].block_efficiency == 1.45
    page = plots.PAGE.read_text(encoding="utf-8")
    for name in (plots.SPEEDUP_PNG, plots.BLOCK_PNG):
        png = plots.PAGE.parent / "img" / name
        assert f"(img/{name})" in page
        assert plots.png_description(png) == plots.rows_digest(rows), (
            f"{png} does not show the page's tables: python benchmarks/plot_real_pair.py")


def test_plot_script_writes_pngs_and_a_changed_table_changes_the_fingerprint(
        tmp_path: Path) -> None:
    plots = _plot_module()
    text = plots.PAGE.read_text(encoding="utf-8")
    rows = plots.read_tables(text)
    paths = plots.plot(rows, tmp_path)
    assert [p.name for p in paths] == [plots.SPEEDUP_PNG, plots.BLOCK_PNG]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert plots.png_description(path) == plots.rows_digest(rows)
    # The CPU-time speed-up of vLLM's eagle3 at batch 1, T = 0 (tok/CPU-s 23.4).
    assert text.count("| 23.4 | **1.12** |") == 1
    edited = plots.read_tables(text.replace("| 23.4 | **1.12** |", "| 23.4 | 1.13 |"))
    assert plots.rows_digest(edited) != plots.rows_digest(rows)


def test_update_docs_tables_rewrites_only_the_generated_block() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import update_docs_tables as upd
    finally:
        sys.path.pop(0)
    page = f"# Knobs\n\nintro\n\n{upd.START} by x -->\n| old |\n|---|\n{upd.END}\n\nafter\n"
    new = upd.with_table(page, "| a |\n|---|\n| 1 |\n")
    assert new == (f"# Knobs\n\nintro\n\n{upd.START} by x -->\n| a |\n|---|\n| 1 |\n"
                   f"{upd.END}\n\nafter\n")
    assert upd.with_table(new, "| a |\n|---|\n| 1 |") == new  # idempotent


def test_readme_headline_is_the_real_pair_pages_numbers() -> None:
    """The README's real-pair table (every default's speed-up per batch and temperature)
    and its date are those of the interleaved matrix on docs/benchmarks/real-pair.md: each
    row the page has, cell for cell."""
    page = (ROOT / "docs" / "benchmarks" / "real-pair.md").read_text(encoding="utf-8")
    matrix = page[page.index("### Every default at batch 1, 8 and 32"):]
    matrix = matrix[:matrix.index("\n### ", 1)]
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Does it pay?"):]
    section = section[:section.index("\n## ", 1)]

    def rows(block: str) -> dict[str, list[str]]:
        table = [_cells_of(line) for line in block.splitlines() if line.startswith("|")]
        out = {}
        for cells in table[2:]:
            names = re.findall(r"`([^`]+)`", cells[0]) or [cells[0]]
            # The cell's first number: the speed-up (the page adds the spread and steps).
            out[names[0]] = [c.strip("*").split(" ")[0] for c in cells[1:]]
        return out

    readme, docs = rows(section), rows(matrix)
    shared = set(readme) & set(docs)
    assert len(shared) >= 4, (readme, docs)
    for name in shared:
        assert readme[name] == docs[name], (name, readme[name], docs[name])
    date = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d-\d\d:\d\d UTC", section)
    assert date and date.group(0) in matrix


def _cells_of(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]
