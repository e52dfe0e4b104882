"""The engine stays reviewable: the audit is an orchestrator of at most 200 lines, and no module
of ``audit/engine`` grows past 400 (work that outgrows one moves to a module of its own)."""
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "audit" / "engine"
MAX_AUDIT_LINES = 200
MAX_MODULE_LINES = 400


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_audit_is_an_orchestrator_of_at_most_200_lines():
    assert _lines(ENGINE / "audit.py") <= MAX_AUDIT_LINES, \
        f"audit/engine/audit.py has {_lines(ENGINE / 'audit.py')} lines; move work out to its own engine module"


def test_no_engine_module_is_over_400_lines():
    sizes = {p.relative_to(ENGINE).as_posix(): _lines(p) for p in sorted(ENGINE.rglob("*.py"))}
    assert "audit.py" in sizes and len(sizes) > 10  # the engine's modules, read from where they are
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"engine modules over {MAX_MODULE_LINES} lines: {over}"
