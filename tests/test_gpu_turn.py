"""The GPU turn's plumbing where no GPU is: each section runs in a process of its own, and a
section that fails reports its exit code and reason instead of stopping the turn; finished
sections are kept in a folder and a later turn resumes from them; the default audit's two
devices are compared (here two CPU runs of a tiny audit stand in for them)."""
import json
from pathlib import Path

import pytest
import torch

from bench import gpu_turn

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks how a section that cannot reach CUDA is reported: on a CUDA machine "
                    "the section would run for real instead of failing")
def test_a_failing_section_reports_its_exit_code_and_reason():
    body, data, ok = gpu_turn.in_own_process("floor", torch.device("cuda"))
    assert body.startswith("failed (exit 2):") and not ok and data == {}, body
    assert "need --device cuda on a machine with a CUDA GPU" in body, body


@pytest.mark.parametrize("name", [n for n, s in gpu_turn.SECTIONS.items()
                                  if n not in ("tests", gpu_turn.REPEATED) and s.device == "cuda"])
def test_the_cli_knows_every_section_the_turn_spawns(name, capsys):
    from bench import bench_throughput

    with pytest.raises(SystemExit) as refused:  # refused for want of CUDA, not as an unknown section
        bench_throughput.main(["--device", "cpu", "--gpu-turn-section", name])
    assert refused.value.code == 2
    assert "need --device cuda" in capsys.readouterr().err


def test_a_test_run_that_does_not_exit_is_stopped_and_said_so():
    text, ok = gpu_turn.cuda_tests(timeout=0.5)  # pytest cannot even start in that time
    assert text.startswith("`pytest -q tests/test_cuda.py`: stopped after 0.5 s without exiting") and not ok


def test_the_paper_audit_reads_the_route_a_result_took(tmp_path):
    result = tmp_path / "s0__ig__i0.json"
    result.write_text('{"trace": {"capture": "graph: capture=\'compiled-graph\'; compiled-graph failed: X"}}')
    assert gpu_turn._capture_trace(result).split(":")[0] == "graph"  # the fallback, not the route asked for
    result.write_text('{"trace": {}}')
    assert gpu_turn._capture_trace(result) == ""


TINY = dict(model="cnn", image_size=8, steps=[0], images=1, budget=8, utility=False, attacks=["ig"])


@pytest.fixture
def tiny(monkeypatch):
    """The turn's audits as tiny ones; each section computed in this process, the names logged."""
    monkeypatch.setattr(gpu_turn, "AUDIT_OVERRIDES", TINY)
    spawned = []

    def spawn(name, device, timeout):
        spawned.append(name)
        return gpu_turn.in_this_process(name, device, timeout)

    return spawn, spawned


def _turn(tmp_path, spawn, **kw):
    page = gpu_turn.run(torch.device("cpu"), tmp_path / "page.md", tmp_path / "turn", budget_s=kw.pop("budget_s", 1e6),
                        only=kw.pop("only", gpu_turn.COMPARED), spawn=spawn)
    return page.read_text()


def test_the_turn_keeps_each_section_and_compares_the_default_audits_devices(tmp_path, tiny):
    spawn, spawned = tiny
    page = _turn(tmp_path, spawn)
    assert spawned == list(gpu_turn.COMPARED)
    kept = {name: json.loads((tmp_path / "turn" / f"{name}.json").read_text()) for name in gpu_turn.COMPARED}
    for name, result in kept.items():
        data = result["data"]
        assert result["ok"] and data["wall_s"] > 0 and data["settings"] == {"images": 4, **TINY}
        assert set(data["steps"]) == {"0"} and data["overall"] == data["steps"]["0"]
        assert f"## {gpu_turn.SECTIONS[name].title}" in page
    assert kept["audit-cuda"]["data"]["steps"] == kept["audit-cpu"]["data"]["steps"]
    assert "## The default audit: CPU / CUDA wall time" in page and "verdicts **identical**" in page


def test_a_later_turn_resumes_from_the_kept_sections(tmp_path, tiny):
    spawn, spawned = tiny
    _turn(tmp_path, spawn)
    first = json.loads((tmp_path / "turn" / "audit-cpu.json").read_text())
    (tmp_path / "turn" / "audit-cpu.json").unlink()  # as if the call had been stopped during it
    page = _turn(tmp_path, spawn)
    assert spawned == ["audit-cuda", "audit-cpu", "audit-cpu"], "a kept section ran again"
    again = json.loads((tmp_path / "turn" / "audit-cpu.json").read_text())
    assert again["data"]["overall"] == first["data"]["overall"] and again["data"]["steps"] == first["data"]["steps"]
    assert page.count("## The make-demo audit") == 2 and "verdicts **identical**" in page


def test_a_section_that_does_not_fit_waits_and_a_failed_one_is_not_kept(tmp_path):
    fits_one = gpu_turn.SECTIONS["audit-cuda"].estimate_s + 5
    page = _turn(tmp_path, lambda *a: ("failed (exit 1): no", {}, False), budget_s=fits_one)
    assert "## The make-demo audit (4 images) on CUDA\n\nfailed (exit 1): no" in page
    assert "on this machine's CPU, 2 threads\n\nNot run yet: about 240 s" in page
    assert not list((tmp_path / "turn").glob("*.json")) and "CPU / CUDA wall time" not in page


def test_the_kernel_count_leaves_views_out_on_both_sides():
    from bench import op_counts

    x = torch.rand(4, 3)
    with op_counts.OpCounter() as counter:
        (x.view(12).unsqueeze(0).expand(2, 12) * 2).t().sum()
    assert dict(counter.ops) == {"mul": 1, "sum": 1}
    assert dict(counter.views) == {"view": 1, "unsqueeze": 1, "expand": 1, "t": 1}
    assert op_counts.extra(counter.ops, {"mul": 1}) == "+1 sum"


def test_a_sections_process_hands_back_its_body_and_numbers(monkeypatch):
    printed = 'torch warnings\n' + gpu_turn.BODY + '\n{"body": "3.0 s", "data": {"wall_s": 3.0}}\n'
    commands = []
    monkeypatch.setattr(gpu_turn, "_run", lambda command, timeout: commands.append(command) or (printed, "", 0))
    assert gpu_turn.in_own_process("audit-cpu", torch.device("cuda"), 60) == ("3.0 s", {"wall_s": 3.0}, True)
    assert commands[0][-6:] == ["--device", "cpu", "--threads", "2", "--gpu-turn-section", "audit-cpu"]


def test_the_sweeps_second_pass_reuses_every_program_and_gives_the_same_verdicts(monkeypatch, fresh_programs):
    # the recording route stands in for a CUDA graph: programs are built and kept as on a GPU
    monkeypatch.setattr(gpu_turn, "AUDIT_OVERRIDES", {**TINY, "attack_args": {"ig": {"capture": "recording"}}})
    body, data = gpu_turn.sweep_memory(torch.device("cpu"))
    first, second = data["passes"]
    assert first["programs"]["built"] > 0 and second["programs"] == {"built": 0, "reused": first["programs"]["built"]}
    assert set(first["verdicts"]) >= set(gpu_turn.SWEEP_GRID) and first["verdicts"] == second["verdicts"]
    assert "Verdicts of the two passes: identical." in body


def test_every_turn_with_time_left_runs_more_papers_slices_from_its_own_folder(tmp_path, monkeypatch):
    """The papers section is never kept as finished: each turn whose other sections are kept
    gives the papers bench what is left of its budget, results in the turn's folder (seeded from
    the committed ones)."""
    commands = []
    printed = "row 1/1 x\n2 slices run in 6.5 of 7.2 minutes; 3 left, ~20 planned minutes in 3 9-minute calls\n"
    monkeypatch.setattr(gpu_turn, "_run", lambda command, timeout: commands.append((command, timeout)) or
                        (printed, "", 0))
    folder = tmp_path / "turn"
    folder.mkdir()
    for name in gpu_turn.SECTIONS:
        if name != gpu_turn.REPEATED:
            (folder / f"{name}.json").write_text(json.dumps({"title": name, "body": "kept", "data": {}, "ok": False,
                                                            "seconds": 1.0}))
    committed = tmp_path / "repo" / "bench" / "results" / "papers"
    (committed / "gpu-embedded" / "row.partial").mkdir(parents=True)
    (committed / "results.jsonl").write_text('{"key": "gpu-embedded/row", "value": {}}\n')
    monkeypatch.setattr(gpu_turn, "ROOT", tmp_path / "repo")
    for _ in range(2):
        page = gpu_turn.run(torch.device("cpu"), tmp_path / "turn.md", folder, budget_s=480).read_text()
    assert len(commands) == 2, "the papers section must run in every turn"
    command, timeout = commands[-1]
    minutes = float(command[command.index("--call-minutes") + 1])
    assert 7.0 <= minutes <= (480 - gpu_turn.PAPERS_MARGIN_S) / 60 and timeout <= 480
    assert command[command.index("--results") + 1] == str(folder / gpu_turn.PAPERS_DIR)
    seeded = folder / gpu_turn.PAPERS_DIR  # from the committed store and cells under way
    assert (seeded / "results.jsonl").read_text() == (committed / "results.jsonl").read_text()
    assert (seeded / "gpu-embedded" / "row.partial").is_dir()
    assert not (folder / "papers.json").exists()
    assert "2 slices run in 6.5 of 7.2 minutes; 3 left" in page
