"""README.md is the front door and docs/ the guide: what the text says must stay true.

The README stays short and opens with the two commands CI runs; what it shares with the
guide (the tour, the porting table) is the same text in both; no page shows a machine's
absolute paths; what the porting page says spmd has not, it has not; the architecture
page names every module; links lead somewhere.  (What programs print is checked by
tests/jobs/test_docs_outputs.py.)
"""

from __future__ import annotations

import importlib
import re

import pytest
from _docs import DOCS, README, ROOT, blocks, check, fenced

QUICKSTART = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[mpich]" '
              "&& mpiexec -n 4 python examples/quickstart.py")
TESTS = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[mpich,test]" '
         "&& tests/run.sh")


def text(path) -> str:
    return path.read_text(encoding="utf-8")


def section(source: str, heading: str) -> str:
    """The body of the ``## heading`` section (up to the next heading of that level)."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", source, re.M | re.S)
    assert m, f"no section {heading!r}"
    return m.group(1)


def test_readme_is_a_front_door():
    lines = text(README).splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the guide goes in docs/"


def test_readme_opens_with_the_two_commands_ci_runs():
    source = text(README)
    first_section = source.index("\n## ")
    commands = re.findall(r"^```bash\n(.*?)\n```$", source[:first_section], re.M | re.S)
    assert commands == [QUICKSTART, TESTS], commands
    ci = text(ROOT / ".ci" / "run").splitlines()
    at = next(i for i, line in enumerate(ci) if line.startswith("# README.md's test command"))
    run = next(line for line in ci[at:] if not line.startswith("#") and "=" not in line[:8])
    assert run.startswith(TESTS + " || "), run   # verbatim, its status kept for the end
    assert "tests/run.sh rest" in "\n".join(ci[at:]), "CI runs the rest of the suite too"


def test_the_tour_is_the_same_in_the_readme_and_the_guide():
    readme = fenced(README, "python", "## A tour")
    guide = fenced(DOCS / "tour.md", "python", "# A tour")
    assert readme == guide
    assert "dist.init_process_group()" in readme


def _links_to_guide(source: str) -> str:
    return source.replace("](docs/", "](")


def test_the_porting_table_is_the_same_in_the_readme_and_the_guide():
    def table(source: str) -> list[str]:
        return [ln for ln in section(source, "Porting from torch.distributed").splitlines()
                if ln.startswith("|")] if source.startswith("# spmd") else \
            [ln for ln in source.split("## API:")[0].splitlines() if ln.startswith("|")]
    readme, guide = table(_links_to_guide(text(README))), table(text(DOCS / "porting.md"))
    assert len(readme) > 10 and readme == guide


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_no_page_shows_a_machines_absolute_paths(page):
    found = re.findall(r"(?:/work/|/home/|/root/|/Users/)\S*", text(page))
    assert not found, f"{page.name}: {found}; show paths relative to the repository"


def test_no_page_includes_readme_sections():
    # docs/ owns the guide's text; the README links to it.
    for page in DOCS.glob("*.md"):
        assert "{readme}" not in text(page), page.name


def _has_not(paragraph: str) -> list[str]:
    """The names a 'Has not' sentence lists; a name before 's (one of its parts) is not."""
    names = []
    for sentence in re.findall(r"Has not[^:]*:(.*?)(?:\.\s*$|\.\s+[A-Z*]|\Z)", paragraph, re.S):
        for m in re.finditer(r"`([A-Za-z_]\w*)`(?!'s)", sentence):
            names.append(m[1])
    return names


def test_what_the_porting_page_says_spmd_has_not_it_has_not():
    import spmd
    from spmd.layouts import parallel_state

    paragraphs = section(text(DOCS / "porting.md"), "API: what spmd has, and what it does not")
    owners = {"**torch.distributed.**": lambda n: n in spmd.__all__ or hasattr(spmd, n),
              "**DeviceMesh**": lambda n: hasattr(spmd.DeviceMesh, n),
              "**Megatron-Core `parallel_state`**": lambda n: hasattr(parallel_state, n)}
    checked = 0
    for head, has in owners.items():
        paragraph = paragraphs.split(head, 1)[1].split("\n\n", 1)[0]
        names = _has_not(paragraph)
        assert names, head
        wrong = [n for n in names if has(n)]
        assert not wrong, f"{head} lists {wrong} under 'Has not', but spmd has them"
        checked += len(names)
    assert checked > 40


def test_the_architecture_page_names_every_public_module():
    page = text(DOCS / "architecture.md")
    tree = page[page.index("```\nspmd/"):]
    tree = tree[:tree.index("\n```")]
    missing = []
    for path in sorted((ROOT / "spmd").rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py", "_version.py"):
            continue
        parts = path.relative_to(ROOT / "spmd").with_suffix("").parts
        if parts[0] == "testing" or any(p.startswith("_") for p in parts):
            continue   # one package, named as such; private modules are their package's
        if not re.search(rf"\b{re.escape(parts[-1])}\b", tree):
            missing.append("/".join(parts))
    assert not missing, f"docs/architecture.md's tree does not name {missing}"


def test_the_settings_table_is_the_declared_one():
    assert not check("settings"), "python tests/_docs.py --write settings"


def test_every_output_block_is_marked_once():
    assert set(blocks()) >= {"quickstart", "spawn", "timeout", "fr-trace", "mismatch",
                             "settings", "exit"}


def _slug(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_links_lead_to_a_file_and_a_heading(page):
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text(page)):
        if re.match(r"\w+:", target):
            continue   # a web address
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
            continue
        if anchor:
            headings = re.findall(r"^#{1,6} (.+)$", text(dest), re.M)
            if anchor not in {_slug(h) for h in headings}:
                bad.append(target)
    assert not bad, f"{page.name}: links to nothing: {bad}"


def test_the_modules_the_pages_reference_exist():
    for page in DOCS.glob("*.md"):
        for name in re.findall(r"\{py:mod\}`([\w.]+)`", text(page)):
            importlib.import_module(name)
