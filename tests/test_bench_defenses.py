"""The default-audit comparison's summary line: each tree's mean and the range of its runs."""
from bench.bench_defenses import _without_from_json, audits_table, trees_summary


def _run(tree, wall, cpu, rc=0):
    return {"defense": "prune", "args": "", "tree": tree, "wall_s": wall, "cpu_s": cpu, "rc": rc,
            "per_attack": {"ig": wall / 2}, "verdict": "leaks", "utility_s": 10.0}


def test_trees_summary_means_each_tree_and_ranges_its_runs():
    runs = [_run("/new", 380, 700), _run("/old", 350, 680), _run("/old", 430, 820), _run("/new", 400, 760),
            _run("/new", 9999, 9999, rc=1)]  # a failed run counts for neither tree
    line = trees_summary(runs, "/new")
    assert "this 390 s wall / 730 s CPU, baseline 390 / 750" in line
    assert "this / baseline 1.00 wall, 0.97 CPU" in line
    assert "wall range: this 380-400 s, baseline 350-430 s" in line
    assert trees_summary(runs[:1], "/new") == ""


def test_audits_table_labels_the_given_tree_this_whatever_ran_first():
    table = audits_table([_run("/old", 350, 680), _run("/new", 380, 700)], "wall", "/new")
    rows = [line for line in table.splitlines() if line.startswith("| prune")]
    assert [r.split("|")[2].strip() for r in rows] == ["baseline", "this"]


def test_the_published_command_leaves_out_where_the_rows_went():
    argv = ["--audits", "--json", "a.json", "--from-json=b.json", "--order", "abba"]
    assert _without_from_json(argv) == ["--audits", "--order", "abba"]
