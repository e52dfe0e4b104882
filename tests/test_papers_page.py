"""docs/papers.md and its details page render from the stored cells exactly as committed: a
change to the rendering, the rows or what the stored cells say shows here as a diff."""
import difflib
import re
import shutil
from pathlib import Path

import pytest
import torch

from audit.core.metrics import MetricUnavailable, lpips_model
from bench.papers import cli, render, store
from bench.papers.cells import Profile

ROOT = Path(__file__).resolve().parents[1]


def _no_lpips() -> str:
    try:
        lpips_model("cpu")
    except MetricUnavailable as err:
        return str(err)
    return ""


@pytest.mark.slow
@pytest.mark.skipif(bool(_no_lpips()), reason="the stored cells' engine keys name LPIPS as the identification "
                    "similarity: the render needs the backbone weights (gia-audit weights lpips)")
def test_the_papers_page_renders_byte_identical_from_the_stored_cells(tmp_path, monkeypatch):
    """The render reads a copy of the stored cells at their path under ``tmp_path``, so a plan
    it refreshes is not written into the repository; the one thing it takes from the machine,
    the torch version on the command's line, is compared as the committed page's."""
    copy = tmp_path / store.RESULTS.relative_to(ROOT)
    shutil.copytree(store.RESULTS, copy)
    monkeypatch.setattr(render, "ROOT", tmp_path)  # a cell under way names its kept folder from the root
    pages = cli.page_texts(["--docs", "papers"], "papers", Profile("cpu"), "embedded", {}, copy, tmp_path / "out")
    assert sorted(str(p.relative_to(ROOT)) for p in pages) == ["bench/results/papers/papers.md", "docs/papers.md"]
    for path, text in pages.items():
        committed = path.read_text()
        version = re.search(r"^`python -m bench\.papers --docs papers` \(torch ([^,]+), ", committed, re.M).group(1)
        text = text.replace(f"(torch {torch.__version__}, ", f"(torch {version}, ", 1)
        diff = list(difflib.unified_diff(committed.splitlines(), text.splitlines(), "committed", "rendered", n=0))
        assert text == committed, (f"{path.relative_to(ROOT)} no longer renders as committed (rerun `python -m "
                                   f"bench.papers --render --docs papers`):\n" + "\n".join(diff[:30]))
