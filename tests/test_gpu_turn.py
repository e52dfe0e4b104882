"""The GPU turn's plumbing where no GPU is: each section runs in a process of its own, and a
section that fails reports its exit code and reason instead of stopping the turn."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_turn  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the section would run for real")
def test_a_failing_section_reports_its_exit_code_and_reason():
    body = gpu_turn.in_own_process("floor", torch.device("cuda"))
    assert body.startswith("failed (exit 2):"), body
    assert "need --device cuda on a machine with a CUDA GPU" in body, body


@pytest.mark.parametrize("name", [n for n in gpu_turn.SECTIONS if n != "tests"])
def test_the_cli_knows_every_section_the_turn_spawns(name, capsys):
    import bench_throughput

    with pytest.raises(SystemExit) as refused:  # refused for want of CUDA, not as an unknown section
        bench_throughput.main(["--device", "cpu", "--gpu-turn-section", name])
    assert refused.value.code == 2
    assert "need --device cuda" in capsys.readouterr().err


def test_a_test_run_that_does_not_exit_is_stopped_and_said_so(monkeypatch):
    monkeypatch.setattr(gpu_turn, "SECTION_TIMEOUT_S", 0.5)  # pytest cannot even start in that time
    assert gpu_turn.cuda_tests().startswith("`pytest -q tests/test_cuda.py`: stopped after 0.5 s without exiting")


def test_the_paper_audit_reads_the_route_a_result_took(tmp_path):
    result = tmp_path / "s0__ig__i0.json"
    result.write_text('{"trace": {"capture": "graph: capture=\'compiled-graph\'; compiled-graph failed: X"}}')
    assert gpu_turn._capture_trace(result).split(":")[0] == "graph"  # the fallback, not the route asked for
    result.write_text('{"trace": {}}')
    assert gpu_turn._capture_trace(result) == ""
