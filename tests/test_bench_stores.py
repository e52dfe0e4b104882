"""Each bench keeps its results in one append-only JSON Lines store,
``bench/results/<bench>/results.jsonl``: a later line with the same key supersedes an earlier one,
and a line a cut write left is skipped."""
import json
import math

from bench.jsonl import FILE, RESULTS, Lines


def test_a_later_line_supersedes_and_keys_may_be_any_json_value(tmp_path):
    lines = Lines(tmp_path / "b" / FILE)
    assert lines.get("x") is None and lines.items() == []
    lines.put("x", {"psnr": [1.0]})
    lines.put(["fl-100", {"seed": 1, "lr": 0.1}], {"accuracy": 0.5})
    lines.put("x", {"psnr": [2.0, math.inf]})
    assert lines.get("x") == {"psnr": [2.0, math.inf]}
    assert lines.get(["fl-100", {"lr": 0.1, "seed": 1}]) == {"accuracy": 0.5}  # in any order of its keys
    assert [k for k, _ in lines.items()] == ["x", ["fl-100", {"seed": 1, "lr": 0.1}]]
    assert len(lines.path.read_text().splitlines()) == 3  # appended, never rewritten


def test_a_line_cut_short_is_skipped_and_the_next_one_stands_on_its_own(tmp_path):
    lines = Lines(tmp_path / FILE)
    lines.put("a", 1)
    with open(lines.path, "a") as fh:
        fh.write('{"key": "b", "value": {"cut')
    lines.put("c", 3)
    assert lines.items() == [("a", 1), ("c", 3)]


def test_the_benches_keep_their_results_in_their_stores():
    stores = sorted(RESULTS.glob(f"*/{FILE}"))
    assert {p.parent.name for p in stores} >= {"control", "conv-span", "papers", "strength", "utility"}
    for store in stores:
        for line in store.read_text().splitlines():
            assert set(json.loads(line)) == {"key", "value"}, store


def test_the_adaptive_span_table_renders_byte_identical_from_its_store():
    import re

    import torch

    from bench import bench_adaptive_span as bench

    rows = bench.stored(Lines.of("adaptive-span"))
    path, text = bench.page(rows, bench.IMAGES, bench.BUDGET, "adaptive-span", "docs/adaptive.md")
    committed = path.read_text()
    version = re.search(r"^`python -m bench\.bench_adaptive_span [^`]*` \(torch ([^,]+), ", committed, re.M).group(1)
    assert text.replace(f"(torch {torch.__version__}, ", f"(torch {version}, ") == committed, (
        "docs/adaptive.md no longer renders from bench/results/adaptive-span: rerun "
        "`python -m bench.bench_adaptive_span --render --docs adaptive-span`")
