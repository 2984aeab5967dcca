"""Pages that show a section of README.md, so that text lives in one place.

A page writes

    ```{readme} When things go wrong
    ```

and gets the body of README's section of that title: the lines after its heading, up to
the next heading of any level (a subsection is included by its own title). A title that
README does not have is a warning, which fails the strict build. Links to README's own
sections (``[text](#slug)``) are pointed at the page whose heading has that slug.
"""

from __future__ import annotations

import re
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

_DIRECTIVE = re.compile(r"^```\{readme\}[ \t]+(?P<title>.+?)[ \t]*\n```[ \t]*$", re.MULTILINE)
_HEADING = re.compile(r"^(?P<hashes>#{1,6})[ \t]+(?P<title>.+?)[ \t]*$")
_LOCAL_LINK = re.compile(r"\]\(#(?P<slug>[\w-]+)\)")


def _slug(title: str) -> str:
    """GitHub's and MyST's anchor of a heading: lower case, punctuation dropped."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return text.replace(" ", "-")


def _sections(readme: Path) -> dict[str, list[str]]:
    """Each heading's title -> the lines of its body (up to the next heading)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    in_code = False
    for line in readme.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else _HEADING.match(line)
        if match:
            current = sections.setdefault(match["title"], [])
        elif current is not None:
            current.append(line)
    return sections


def _anchors(srcdir: Path) -> dict[str, str]:
    """Heading slug -> the page (docname) whose level-1 or level-2 heading has it."""
    anchors: dict[str, str] = {}
    for page in sorted(srcdir.glob("*.md")):
        in_code = False
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                in_code = not in_code
            match = None if in_code else _HEADING.match(line)
            if match and len(match["hashes"]) <= 2:
                anchors.setdefault(_slug(match["title"]), page.stem)
    return anchors


def _expand(app: Sphinx, docname: str, source: list[str]) -> None:
    """Replace each ``{readme}`` block of a page with README's section of that title."""
    if "{readme}" not in source[0]:
        return
    readme = Path(app.confdir).parent / "README.md"
    app.env.note_dependency(str(readme))  # README edits rebuild the pages that show it
    sections = _sections(readme)
    anchors = _anchors(Path(app.srcdir))

    def link(match: re.Match[str]) -> str:
        target = anchors.get(match["slug"])
        if target is None or target == docname:
            return match.group(0)
        return f"]({target}.md#{match['slug']})"

    def body(match: re.Match[str]) -> str:
        title = match["title"]
        if title not in sections:
            logger.warning("README.md has no section titled %r", title,
                           location=docname, type="readme", subtype="missing")
            return ""
        text = "\n".join(sections[title]).strip("\n")
        return _LOCAL_LINK.sub(link, text)

    source[0] = _DIRECTIVE.sub(body, source[0])


def setup(app: Sphinx) -> dict[str, object]:
    """Register the expansion of ``{readme}`` blocks."""
    app.connect("source-read", _expand)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
