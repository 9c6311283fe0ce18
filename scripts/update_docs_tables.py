"""Rewrite the generated tables of the documentation site from the code.

    python scripts/update_docs_tables.py          # rewrite in place
    python scripts/update_docs_tables.py --check  # exit 1 if a page is out of date

Today one table: the knobs and defaults of every method, ``defaults_table_markdown()`` of
``vllm_specx/methods.py``, between the generated-table markers of docs/methods/knobs.md
(tests/glue/test_docs_and_backend_choice.py fails until the page matches the code).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KNOBS_PAGE = ROOT / "docs" / "methods" / "knobs.md"
START = "<!-- generated from vllm_specx/methods.py"
END = "<!-- end of generated table -->"


def with_table(page: str, table: str) -> str:
    """``page`` with the text between its markers replaced by ``table``."""
    start = page.index(START)
    body = page.index("\n", start) + 1  # the table starts on the line after the marker
    end = page.index(END, body)
    return page[:body] + table.strip() + "\n" + page[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report, do not write")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from vllm_specx.methods import defaults_table_markdown

    page = KNOBS_PAGE.read_text(encoding="utf-8")
    new = with_table(page, defaults_table_markdown())
    if new == page:
        print(f"{KNOBS_PAGE.relative_to(ROOT)}: up to date")
        return 0
    if args.check:
        print(f"{KNOBS_PAGE.relative_to(ROOT)}: out of date (python scripts/update_docs_tables.py)")
        return 1
    KNOBS_PAGE.write_text(new, encoding="utf-8")
    print(f"{KNOBS_PAGE.relative_to(ROOT)}: rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
