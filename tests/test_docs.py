"""Docstrings stay short, code and docs describe the software (not how it was made), and every
table in ``docs/`` names the bench command that rewrites it."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("audit", "attacks", "adaptive", "defenses", "priors", "generators", "tests", "bench")
MAX_DOCSTRING_LINES = 25
# words that narrate the work instead of describing the software
NARRATION = re.compile(r"\b(stop \d+|issue \d+|issue's|(this|that|a) session|device lease|no GPU lent)\b", re.I)


def python_files():
    return [ROOT / "cli.py"] + [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def text_files():
    return python_files() + [ROOT / "README.md"] + sorted(ROOT.glob("*/README.md")) + sorted((ROOT / "docs").glob("*.md"))


def long_docstrings(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and len(doc.strip().splitlines()) > MAX_DOCSTRING_LINES:
                yield f"{path.name}: {getattr(node, 'name', 'module')} ({len(doc.strip().splitlines())} lines)"


def test_no_docstring_is_longer_than_25_lines():
    found = [hit for path in python_files() for hit in long_docstrings(path)]
    assert not found, f"docstrings over {MAX_DOCSTRING_LINES} lines (move detail to docs/): {found}"


def test_the_guards_are_not_vacuous(tmp_path):
    """A long docstring and a narrating line are found."""
    sample = tmp_path / "m.py"
    sample.write_text('"""' + "line\n" * 30 + '"""\n\n\ndef f():\n    """' + "line\n" * 25 + '"""\n')
    assert list(long_docstrings(sample)) == ["m.py: module (30 lines)"]
    assert NARRATION.search("measured in stop 18") and NARRATION.search("see issue 12")
    assert not NARRATION.search("the FL round 1 and the session key")


def test_code_and_docs_describe_the_software():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in text_files() for n, line in enumerate(path.read_text().splitlines(), 1)
             if path != Path(__file__) and NARRATION.search(line)]
    assert not found, f"lines narrating how the work went (say what the software does): {found}"


def test_every_docs_table_names_the_command_that_rewrites_it():
    pages = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "bench" / "results").glob("*/*.md"))
    blocks = 0
    for page in pages:
        text = page.read_text()
        begins = re.findall(r"<!-- bench:([\w.-]+):begin -->", text)
        ends = re.findall(r"<!-- bench:([\w.-]+):end -->", text)
        assert begins == ends and len(set(begins)) == len(begins), f"{page.name}: unpaired bench markers"
        for name in begins:
            body = text.split(f"<!-- bench:{name}:begin -->")[1].split(f"<!-- bench:{name}:end -->")[0].strip()
            if body:  # an empty section waits for its bench's first run
                blocks += 1
                assert body.startswith("`python -m bench.") and f"--docs {name}`" in body.splitlines()[0], \
                    f"{page.name}: table {name!r} does not start with the bench command that writes it"
    assert blocks >= 10
