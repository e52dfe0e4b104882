"""A bench's store: one append-only JSON Lines file, ``bench/results/<bench>/results.jsonl``.

Each line is one finished result, ``{"key": KEY, "value": VALUE}``: KEY is what it is kept under
(a name, or a JSON value of everything that changes its numbers), and a later line with the same
key supersedes an earlier one. A run appends a line as each result finishes, so an interrupted run
resumes from the file and a page renders from it; a line a cut write left unreadable is skipped.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

from bench.docs_table import ROOT

RESULTS = ROOT / "bench" / "results"
FILE = "results.jsonl"


def _canonical(key: Any) -> str:
    return json.dumps(key, sort_keys=True)


class Lines:
    """The results file at ``path`` (created by the first :meth:`put`)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def of(cls, bench: str) -> "Lines":
        """The store of ``bench`` (``bench/results/<bench>/results.jsonl``)."""
        return cls(RESULTS / bench / FILE)

    def _latest(self) -> Dict[str, Tuple[Any, Any]]:
        out: Dict[str, Tuple[Any, Any]] = {}
        try:
            with open(self.path, "rb") as fh:
                for line in fh:
                    try:
                        entry = json.loads(line)
                        out[_canonical(entry["key"])] = (entry["key"], entry["value"])
                    except (ValueError, TypeError, KeyError):
                        continue
        except FileNotFoundError:
            pass
        return out

    def items(self) -> List[Tuple[Any, Any]]:
        """Every key with its latest value, in the order the keys first appear."""
        return list(self._latest().values())

    def get(self, key: Any, default: Any = None) -> Any:
        """The latest value kept under ``key`` (``default`` if none)."""
        return self._latest().get(_canonical(key), (None, default))[1]

    def put(self, key: Any, value: Any, sort_keys: bool = False) -> None:
        """Append ``value`` under ``key`` in one write (a line of its own even after a cut one)."""
        line = json.dumps({"key": key, "value": value}, sort_keys=sort_keys, default=str).encode() + b"\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size and not _ends_in_newline(self.path):
                line = b"\n" + line
            while line:
                line = line[os.write(fd, line):]
        finally:
            os.close(fd)


def _ends_in_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"
