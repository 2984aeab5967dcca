"""The outputs the documents show are what their programs print today.

Each block a page marks ``<!-- output: NAME -->`` is produced again here (a job under
mpiexec, or the page's own example) and compared with the page, leaving out only what
differs between runs (tests/_docs.py says what).  A page that fails here is brought up
to date with ``python tests/_docs.py --write NAME``.
"""

from __future__ import annotations

import pytest
from _docs import CASES, blocks, check

JOBS = [name for name, case in CASES.items() if case.job]


def test_every_case_is_on_a_page_and_every_block_is_a_case():
    assert sorted(blocks()) == sorted(CASES)


@pytest.mark.timeout(200)
@pytest.mark.same_on_every_mpi   # spmd's own text; the launcher's is not shown
@pytest.mark.parametrize("name", JOBS)
def test_docs_show_what_the_programs_print(name):
    problems = check(name)
    assert not problems, "\n\n".join(problems) + (
        f"\n\nif the new output is right: python tests/_docs.py --write {name}")
