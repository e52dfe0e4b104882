"""The README and the docs pages stay references: a bounded length, readable lines, a summary
with numbers at the top, links that resolve, and every command quoted in a table exists (a
``gia-audit`` subcommand and its options in the CLI, a ``python -m bench.X`` bench and its
options in that bench)."""
import re
from pathlib import Path

import click
import pytest

from cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
# lines per page; a docs page not named here gets DEFAULT_LINES
MAX_LINES = {"README.md": 250, "docs/strength.md": 350, "docs/performance.md": 300,
             "docs/reference.md": 400}  # the reference holds the generated table of every setting
DEFAULT_LINES = 350
MAX_LINE_CHARS = 500  # outside code blocks
SUMMARY_LINES = 40


def pages():
    return ["README.md"] + [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield n, line


def long_lines(text: str, limit: int = MAX_LINE_CHARS):
    return [(n, len(line)) for n, line in prose_lines(text) if len(line) > limit]


def table_commands(text: str):
    """Backticked commands in table rows: ``gia-audit ...`` and ``python -m bench.X ...``."""
    for _, line in prose_lines(text):
        if line.lstrip().startswith("|"):
            for span in re.findall(r"`([^`]+)`", line):
                if span.startswith(("gia-audit ", "python -m bench.", ".venv/bin/gia-audit ")):
                    yield span


def options(words):
    return [w.split("=")[0] for w in words if w.startswith("--")]


def missing_in_cli(command: str):
    """What of a ``gia-audit`` command the CLI does not have."""
    words = command.replace("\\|", "|").split()[1:]
    group, path = cli_main, ["gia-audit"]
    while isinstance(group, click.Group) and words and not words[0].startswith("-"):
        sub = group.commands.get(words[0])
        if sub is None:
            return [f"{' '.join(path)} has no subcommand {words[0]!r}"]
        group, path, words = sub, path + [words.pop(0)], words
    known = {o for p in group.params for o in p.opts + p.secondary_opts} | {"--help", "-h"}
    return [f"{' '.join(path)} has no option {o}" for o in options(words) if o not in known]


def missing_in_bench(command: str):
    """What of a ``python -m bench.X`` command the bench (a module, or a package's modules) or
    the docs writer does not have."""
    words = command.split()
    name = words[2]
    where = ROOT / Path(*name.split("."))
    files = sorted(where.glob("*.py")) if where.is_dir() else [where.with_suffix(".py")]
    if not files or not files[0].is_file():
        return [f"no bench {name}"]
    source = "".join(f.read_text() for f in files) + (ROOT / "bench" / "docs_table.py").read_text()
    modules = re.findall(r"^from bench\.(\w+) import", source, flags=re.M)
    modules += [m for line in re.findall(r"^from bench import ([\w, ]+)", source, flags=re.M) for m in line.split(", ")]
    for module in dict.fromkeys(modules):  # the options a bench module of the script adds
        path = ROOT / "bench" / f"{module.strip()}.py"
        source += path.read_text() if path.is_file() else ""
    return [f"{name} has no option {o}" for o in options(words[3:])
            if f'"{o}"' not in source and f"'{o}'" not in source]


def links(text: str):
    """Relative link targets of a Markdown page (no URL, no in-page anchor)."""
    for _, line in prose_lines(text):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
                yield target.split("#")[0]


@pytest.mark.parametrize("page", pages())
def test_page_length_and_line_width(page):
    text = (ROOT / page).read_text()
    limit = MAX_LINES.get(page, DEFAULT_LINES)
    assert len(text.splitlines()) <= limit, \
        f"{page}: {len(text.splitlines())} lines, at most {limit} (move how a default was chosen to bench/results/)"
    assert not long_lines(text), f"{page}: lines over {MAX_LINE_CHARS} characters (line, length): {long_lines(text)}"


@pytest.mark.parametrize("page", pages())
def test_page_opens_with_a_summary_with_numbers(page):
    head = (ROOT / page).read_text().splitlines()[:SUMMARY_LINES]
    rows = [line for line in head if line.lstrip().startswith("|") and re.search(r"\d", line)]
    assert head[0].startswith("# ") and rows, f"{page}: no table with numbers in its first {SUMMARY_LINES} lines"


@pytest.mark.parametrize("page", pages())
def test_commands_in_tables_exist(page):
    found = []
    for command in table_commands((ROOT / page).read_text()):
        command = command.removeprefix(".venv/bin/")
        found += missing_in_cli(command) if command.startswith("gia-audit") else missing_in_bench(command)
    assert not found, f"{page}: {found}"


def test_every_link_resolves():
    found = [f"{page}: {target}" for page in pages() + [str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").glob("*/*.md")]
             for target in links((ROOT / page).read_text())
             if not ((ROOT / page).parent / target).exists()]
    assert not found, f"links to nothing: {found}"


def test_the_checks_find_what_they_look_for():
    page = ("# T\n\n| a | `gia-audit audit --defense x --no-such` |\n| b | `gia-audit nope` |\n"
            "| c | `python -m bench.no_bench` | `python -m bench.bench_budget --factor 10 --nope 1` |\n"
            "```\n" + "x" * 900 + "\n```\n" + "y" * 501 + "\n[a](missing.md) [b](https://x.org) [c](#anchor)\n")
    commands = list(table_commands(page))
    assert missing_in_cli(commands[0]) == ["gia-audit audit has no option --no-such"]
    assert missing_in_cli(commands[1]) == ["gia-audit has no subcommand 'nope'"]
    assert missing_in_cli("gia-audit weights lpips --force") == []
    assert missing_in_bench(commands[2]) == ["no bench bench.no_bench"]
    assert missing_in_bench(commands[3]) == ["bench.bench_budget has no option --nope"]
    assert missing_in_bench("python -m bench.papers --profile gpu --plan") == []
    assert missing_in_bench("python -m bench.papers --nope") == ["bench.papers has no option --nope"]
    assert long_lines(page) == [(9, 501)]
    assert list(links(page)) == ["missing.md"]
