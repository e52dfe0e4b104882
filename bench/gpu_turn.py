"""What a lent GPU should measure, in one command (``bench_throughput.py --device cuda --gpu-turn``)
and one Markdown file: the CUDA tests, the floor table, the op counts and the paper-scale audit
at a reduced budget with its projected full time. Sized for under 8 minutes on one H100.

The paper-scale audit: IG on 32 images of the CIFAR ResNet-18 (width 64, 32x32, client in train
mode), one restart each, one step, no utility measurement. A first run builds (compiles) the
program; two more at reduced budgets reuse it with the capture route the full budget would take:
the difference of their wall times gives the seconds per iteration, the rest is the one-off cost
of a run (planning, capturing), and the full run's time is projected from these and the build.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
PAPER_IMAGES = 32
#: the full budget projected to: Inverting Gradients' iterations for a CIFAR ResNet (breaching's
#: ``invertinggradients`` configuration: 24,000)
PAPER_ITERATIONS = 24_000
REDUCED = (100, 300)
#: seconds one CUDA test may take before it is stopped (where pytest-timeout is installed)
TEST_TIMEOUT_S = 150
#: seconds one section's process may take before it is stopped
SECTION_TIMEOUT_S = 300
#: the turn's sections: name (``--gpu-turn-section``) and title
SECTIONS = {"tests": "CUDA tests", "floor": "IG throughput beside its floor", "ops": "Operations per iteration",
            "paper": "The paper-scale audit"}
#: the line after which a section's process prints its body
BODY = "--- gpu-turn section body ---"


def _run(command: List[str]) -> Tuple[str, str, Optional[int]]:
    """``command``'s stdout, stderr and exit code (None: stopped after :data:`SECTION_TIMEOUT_S`,
    with what it printed by then)."""
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SECTION_TIMEOUT_S)
    except subprocess.TimeoutExpired as stopped:
        def text(output) -> str:
            return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")
        return text(stopped.stdout), text(stopped.stderr), None
    return done.stdout, done.stderr, done.returncode


def cuda_tests() -> str:
    """``pytest tests/test_cuda.py``: its summary line, and its failures' report when some fail."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "--durations=5", "-p", "no:cacheprovider",
               "-p", "no:logging", "tests/test_cuda.py"]  # no captured log: torch's debug lines hid the reasons
    if importlib.util.find_spec("pytest_timeout"):  # a hung capture costs one test, not the turn
        command.append(f"--timeout={TEST_TIMEOUT_S}")
    stdout, stderr, code = _run(command)
    lines = stdout.strip().splitlines()
    if code is None:  # a process that does not exit (seen after a compile)
        summary = f"stopped after {SECTION_TIMEOUT_S} s without exiting"
    else:
        summary = lines[-1] if lines else stderr.strip()[-500:]
    text = f"`pytest -q tests/test_cuda.py`: {summary} ({time.perf_counter() - start:.0f} s)"
    if code != 0:
        text += "\n\n```\n" + "\n".join(lines[-150:]) + "\n```"
    return text


def _capture_trace(result: Path) -> str:
    """The capture line of one stored result (its route first, then why)."""
    return str((json.loads(result.read_text()).get("trace") or {}).get("capture", ""))


def paper_audit(device: torch.device) -> str:
    """The paper-scale audit at :data:`REDUCED` budgets and its projected time at :data:`PAPER_ITERATIONS`."""
    import audit
    from attacks import capture

    members = PAPER_IMAGES * PAPER_ITERATIONS
    route = "compiled-graph" if members >= capture.COMPILE_MIN_MEMBER_ITERATIONS else "graph"
    seconds, notes = [], ""
    for budget in (REDUCED[0],) + REDUCED:  # the first run builds (compiles) the program the others reuse
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            report = audit.run(defense="none", model="resnet18", steps=[0], attacks=["ig"], images=PAPER_IMAGES,
                               budget=budget, attack_args={"ig": {"capture": route}}, utility=False, progress=False,
                               device=str(device), out=out, seed=0)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
            taken = {_capture_trace(f).split(":")[0] for f in Path(out).rglob("s0__ig__i*.json")}
            notes = (f"worst-case PSNR at budget {budget}: {report.psnr(0):.2f} dB; route taken: "
                     f"{', '.join(sorted(taken)) or 'not recorded'}")  # a failed compile falls back to `graph`
    first, seconds = seconds[0], seconds[1:]
    per_iteration = (seconds[1] - seconds[0]) / (REDUCED[1] - REDUCED[0])
    fixed = seconds[0] - per_iteration * REDUCED[0]
    full = first - seconds[0] + fixed + per_iteration * PAPER_ITERATIONS
    rows = ["| budget (iterations) | wall s |", "|---:|---:|"] + \
        [f"| {REDUCED[0]}, the first run (builds the program) | {first:.1f} |"] + \
        [f"| {b} | {s:.1f} |" for b, s in zip(REDUCED, seconds)] + \
        [f"| {PAPER_ITERATIONS} (projected) | {full:.0f} |"]
    return (f"IG on {PAPER_IMAGES} images of ResNet-18 (width 64, 32x32, train-mode BatchNorm), 1 restart, "
            f"step 0, capture route `{route}` (the one the full budget takes):\n\n" + "\n".join(rows) +
            f"\n\n{per_iteration * 1e3:.2f} ms per iteration for the {PAPER_IMAGES} images "
            f"({per_iteration * 1e3 / PAPER_IMAGES:.3f} ms per image-iteration), one-off {fixed:.1f} s in a run "
            f"that reuses the program, {first - seconds[0]:.1f} s more to build it; {notes}.")


def in_own_process(name: str, device: torch.device) -> str:
    """One section's body, computed by ``bench_throughput.py --gpu-turn-section name`` in a process
    of its own: a fault that poisons the CUDA context (an illegal address) or a hang costs that
    section alone."""
    command = [sys.executable, str(ROOT / "bench" / "bench_throughput.py"), "--device", str(device),
               "--gpu-turn-section", name]
    stdout, stderr, code = _run(command)
    if code is None:
        return f"failed: stopped after {SECTION_TIMEOUT_S} s"
    if code == 0 and BODY in stdout:
        return stdout.split(BODY, 1)[1].strip()
    return f"failed (exit {code}):\n\n```\n" + "\n".join(stderr.strip().splitlines()[-30:]) + "\n```"


def run(device: torch.device, out: Path) -> Path:
    """Every section in turn, each but the tests in a process of its own (a failing one says why and
    the others still run), into ``out``; the file is rewritten after each section."""
    sections: List[str] = [f"# A GPU turn\n\n`python bench/bench_throughput.py --device cuda --gpu-turn` "
                           f"(torch {torch.__version__}, {torch.cuda.get_device_name(device)})."]
    start = time.perf_counter()
    for name, title in SECTIONS.items():
        began = time.perf_counter()
        body = cuda_tests() if name == "tests" else in_own_process(name, device)
        sections.append(f"## {title}\n\n{body}\n\n({time.perf_counter() - began:.0f} s)")
        print(sections[-1], flush=True)
        out.write_text("\n\n".join(sections) + "\n")  # a turn cut short keeps its finished sections
    sections.append(f"Whole turn: {time.perf_counter() - start:.0f} s.")
    out.write_text("\n\n".join(sections) + "\n")
    return out
