"""The benches are one package run from the repository root (``python -m bench.<bench>``): no
module edits ``sys.path`` or grows past a reviewable size, and the papers bench's rows are data
whose every field is named."""
import ast
import re
from pathlib import Path

from bench.papers.rows import ROWS

ROOT = Path(__file__).resolve().parents[1]
#: the most lines a bench module may hold
MAX_MODULE_LINES = 600
#: the calls that build the papers bench's rows
ROW_TYPES = {"Row", "AttackRef", "PaperSetting", "Scale", "censor_setting", "svd_setting"}


def test_no_bench_or_test_module_edits_sys_path():
    found = [f"{p.relative_to(ROOT)}:{n}" for folder in ("bench", "tests") for p in sorted((ROOT / folder).rglob("*.py"))
             if p != Path(__file__)
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"sys\.path\.(insert|append)", line)]
    assert not found, f"import the bench package instead (run from the repository root): {found}"


def test_no_bench_module_is_over_the_size_limit():
    found = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "bench").rglob("*.py"))
             if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not found, f"bench modules over {MAX_MODULE_LINES} lines: {found}"


def test_the_papers_rows_name_every_field_and_have_unique_ids():
    source = (ROOT / "bench" / "papers" / "rows.py").read_text()
    positional = [f"{node.func.id} at line {node.lineno}" for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ROW_TYPES
                  and node.args]
    assert not positional, f"positional arguments in the rows: {positional}"
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids)) == 27
