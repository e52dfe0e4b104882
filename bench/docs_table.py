"""Benchmarks write their own tables into ``docs/``.

``--docs NAME`` on a bench puts the run's command line and its Markdown table between the
lines ``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->`` of the bench's page, so
rerunning the command written there (``python -m bench.<bench>``, from the repository root)
refreshes that table and nothing else. A bench whose measurements behind a default live apart
from its docs page (``bench/results/<bench>/<bench>.md``, linked from the page) names that file
too; the section is written where its markers are.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]


def add_docs_option(parser: argparse.ArgumentParser, page: str, results: Optional[str] = None) -> None:
    """``--docs NAME``: write the table into ``page`` (relative to the repository root), or into
    ``results`` when that file holds the section NAME."""
    where = page if results is None else f"{page} or {results}"
    parser.add_argument("--docs", metavar="NAME", default=None,
                        help=f"write the table into {where}, between its <!-- bench:NAME:begin/end --> lines")
    parser.set_defaults(docs_page=page if results is None else (page, results))


def section_page(pages, name: str) -> str:
    """The one of ``pages`` (a path or a tuple of paths) that holds the section ``name``; the
    first when none does (``write_table`` then names the missing markers)."""
    pages = (pages,) if isinstance(pages, str) else tuple(pages)
    for page in pages:
        path = ROOT / page
        if path.exists() and f"<!-- bench:{name}:begin -->" in path.read_text():
            return page
    return pages[0]


def command_line(module: str, argv: Optional[Sequence[str]]) -> str:
    """The command that reproduces this run from the repository root, as written in the docs
    (``module``: the bench's module, ``bench.bench_attack``)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def without_options(argv: Optional[Sequence[str]], valued: Sequence[str] = (),
                    flags: Sequence[str] = ()) -> List[str]:
    """``argv`` (default: this process's) without the options ``valued`` (with their value,
    ``--opt v`` or ``--opt=v``) and ``flags``: the command a docs page names, without what
    does not change its numbers."""
    words, out, skip = list(sys.argv[1:] if argv is None else argv), [], False
    for w in words:
        if skip:
            skip = False
        elif w in valued:
            skip = True
        elif w not in flags and not w.startswith(tuple(f"{o}=" for o in valued)):
            out.append(w)
    return out


def with_table(page, name: str, command: str, table: str, setting: str = "") -> Tuple[Path, str]:
    """The text of ``page`` (or of the one of several pages that holds the section ``name``)
    with that section replaced by ``command`` (and ``setting``: torch version, threads, device)
    and ``table``; and the page's path. Writes nothing."""
    page = section_page(page, name)
    path = ROOT / page
    text = path.read_text()
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{page} has no section {name!r}: add the lines {begin} and {end} where its table belongs")
    head, rest = text.split(begin)
    tail = rest.split(end)[1]
    where = f" ({setting})" if setting else ""
    return path, f"{head}{begin}\n`{command}`{where}:\n\n{table.strip()}\n{end}{tail}"


def write_table(page, name: str, command: str, table: str, setting: str = "") -> Path:
    """Write :func:`with_table`'s text into its page."""
    path, text = with_table(page, name, command, table, setting)
    path.write_text(text)
    return path


def publish(args: argparse.Namespace, module: str, argv: Optional[Sequence[str]], table: str,
            setting: str = "") -> None:
    """Write ``table`` into the docs when ``--docs`` was given."""
    if getattr(args, "docs", None):
        path = write_table(args.docs_page, args.docs, command_line(module, argv), table, setting)
        print(f"wrote table {args.docs!r} into {path}", flush=True)
