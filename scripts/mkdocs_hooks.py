"""MkDocs hooks for the documentation site (mkdocs.yml ``hooks:``).

The package's docstrings are reStructuredText-flavoured (``:class:`X```, ``:mod:`.x```),
which mkdocstrings renders as Markdown: the role prefix would show as literal text
(":class:" before the code span). Dropping the prefix leaves the name as inline code.
"""

from __future__ import annotations

import re
from typing import Any

# After Markdown rendering a role reads ":class:<code>X</code>"; keep the code span.
_ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|obj|exc|const):(?=<code>)")
# The table of contents keeps headings as plain text: ":class: VerifyBatch" there.
_ROLE_TEXT = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|obj|exc|const):\s*")


def _clean_toc(items: Any) -> None:
    for item in items:
        item.title = _ROLE_TEXT.sub("", item.title)
        _clean_toc(item.children)


def on_page_content(html: str, page: Any, **_: Any) -> str:
    """Strip Sphinx role prefixes in front of inline code in every rendered page."""
    _clean_toc(page.toc)
    return _ROLE.sub("", html)
