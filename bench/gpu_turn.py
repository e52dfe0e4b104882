"""What a lent GPU should measure, in one command (``bench_throughput.py --device cuda --gpu-turn``)
and one Markdown file: the default audit on CUDA and on the same machine's CPU, a two-defense
sweep, the CUDA tests, the floor table, the kernel counts and the paper-scale audit; then, in
every turn with time left, more slices of the papers' gpu profile (:func:`papers_slices`).

Each section (:data:`SECTIONS`) runs in a process of its own and is kept in a folder as soon as it
finishes; a later turn with that folder runs only the rest. A section starts only while its
estimate fits the turn's budget (:data:`TURN_BUDGET_S`, one 9-minute call). Where files come back
from ``$OUT`` only, keep the folder there, seeded with the committed one, and commit what returns::

    mkdir -p $OUT/gpu-turn && cp bench/results/gpu-turn/*.json $OUT/gpu-turn/ 2>/dev/null; python -m \
      bench.bench_throughput --device cuda --gpu-turn --gpu-turn-dir $OUT/gpu-turn --gpu-turn-out $OUT/gpu-turn.md

and copy ``gpu-turn/papers-gpu/results.jsonl`` and ``gpu-embedded`` back over those of
``bench/results/papers/``.

The default audit: ``make demo``'s (every default, 4 images) on CUDA and on the CPU with 2 threads
(wall-time ratio, verdicts compared); the 8-image default on CUDA only, as on 2 cores the 4-image
audit takes about 3 minutes and the 8-image one would not leave room for the rest of a call. The
sweep: two defenses audited twice into fresh folders (programs built and reused; reserved memory
after each pass). The paper-scale audit: IG on 32 images of the width-64 ResNet-18 (train-mode
client), one restart, one step; a first run builds the program, two more at reduced budgets reuse
it, and the full budget's time is projected from their difference and the build.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from bench.jsonl import FILE

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
#: seconds a whole turn may take (one call of 9 minutes, less the machine's start and the transfers)
TURN_BUDGET_S = 510
#: the line after which a section's process prints its result (JSON: body and data)
BODY = "--- gpu-turn section body ---"
#: the audits of the turn, as ``audit.run`` settings over its defaults: ``make demo``'s and the default
AUDITS: Dict[str, Dict[str, Any]] = {"demo": {"images": 4}, "default": {}}
#: settings every audit and sweep of the turn adds (none: as a user runs them; a test makes them tiny)
AUDIT_OVERRIDES: Dict[str, Any] = {}
#: the sweep: two defenses at their default settings, audited as the demo is, without utility
SWEEP_GRID: Dict[str, Dict[str, Any]] = {"prune": {}, "gaussian": {}}
SWEEP_SETTINGS: Dict[str, Any] = {"images": 4, "utility": False}

#: a section's result: its Markdown body, its numbers, and whether it ran to its end
Result = Tuple[str, Dict[str, Any], bool]


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of the turn: its title, the seconds it is expected to take (a turn starts it
    only with this much of its budget left), where it runs and with how many CPU threads."""

    title: str
    estimate_s: float
    device: str = "cuda"
    threads: int = 2


#: the turn's sections, in the order it runs them (name: ``--gpu-turn-section``)
SECTIONS: Dict[str, Section] = {
    "audit-cuda": Section("The make-demo audit (4 images) on CUDA", 90),
    "audit-cpu": Section("The make-demo audit (4 images) on this machine's CPU, 2 threads", 240, device="cpu"),
    "sweep": Section("A two-defense sweep, twice: programs and reserved memory", 150),
    "audit-cuda-8": Section("The default audit (8 images) on CUDA", 120),
    "tests": Section("CUDA tests", 100),
    "floor": Section("IG throughput beside its floor", 80),
    "ops": Section("Kernels per iteration", 30),
    "paper": Section("The paper-scale audit", 180),
    "papers": Section("The papers' GPU rows, slice by slice", 150),
}
#: the section that is never finished: each turn with time left runs more of the papers' gpu
#: profile (:mod:`bench.papers`' slices), kept in the turn's folder under PAPERS_DIR
REPEATED = "papers"
PAPERS_DIR = "papers-gpu"
#: seconds a turn keeps for the papers bench's own start and its last write
PAPERS_MARGIN_S = 45
#: the pair of sections whose wall times and verdicts the page compares
COMPARED = ("audit-cuda", "audit-cpu")


def _run(command: List[str], timeout: float = SECTION_TIMEOUT_S) -> Tuple[str, str, Optional[int]]:
    """``command``'s stdout, stderr and exit code (None: stopped after ``timeout`` seconds, with
    what it printed by then)."""
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as stopped:
        def text(output) -> str:
            return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")
        return text(stopped.stdout), text(stopped.stderr), None
    return done.stdout, done.stderr, done.returncode


def cuda_tests(timeout: float = SECTION_TIMEOUT_S) -> Tuple[str, bool]:
    """``pytest tests/test_cuda.py``: its summary line, and its failures' report when some fail;
    whether every test passed or skipped."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "--durations=5", "-p", "no:cacheprovider",
               "-p", "no:logging", "tests/test_cuda.py"]  # no captured log: torch's debug lines hid the reasons
    if importlib.util.find_spec("pytest_timeout"):  # a hung capture costs one test, not the turn
        command.append(f"--timeout={TEST_TIMEOUT_S}")
    stdout, stderr, code = _run(command, timeout)
    lines = stdout.strip().splitlines()
    if code is None:  # a process that does not exit (seen after a compile)
        summary = f"stopped after {timeout:g} s without exiting"
    else:
        summary = lines[-1] if lines else stderr.strip()[-500:]
    text = f"`pytest -q tests/test_cuda.py`: {summary} ({time.perf_counter() - start:.0f} s)"
    if code != 0:
        text += "\n\n```\n" + "\n".join(lines[-150:]) + "\n```"
    return text, code == 0


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mib(n: int) -> float:
    return round(n / 2 ** 20, 1)


def _programs(before: Dict[str, int]) -> Dict[str, int]:
    from attacks import capture

    return {k: capture.STATS[k] - before[k] for k in ("built", "reused")}


def verdicts(report) -> Dict[str, Any]:
    """An audit report's overall verdict and each step's."""
    return {"overall": report.verdict, "steps": {str(s["step"]): s["verdict"]["label"] for s in report.steps}}


def default_audit(device: torch.device, which: str) -> Tuple[str, Dict[str, Any]]:
    """One of :data:`AUDITS` on ``device`` in a folder of its own: its wall time, peak reserved
    memory (CUDA), programs built and reused, verdicts and worst-case PSNR per step."""
    import audit
    from attacks import capture

    settings = {**AUDITS[which], **AUDIT_OVERRIDES}
    before = dict(capture.STATS)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        report = audit.run(device=str(device), out=out, progress=False, **settings)
        _sync(device)
        wall = time.perf_counter() - start
    data = {"audit": which, "settings": settings, "wall_s": round(wall, 2), "threads": torch.get_num_threads(),
            "programs": _programs(before), **verdicts(report),
            "worst_psnr": {str(s["step"]): report.psnr(s["step"]) for s in report.steps}}
    if device.type == "cuda":
        data["peak_reserved_mib"] = _mib(torch.cuda.max_memory_reserved(device))
    shown = ", ".join(f"{k} {v}" for k, v in settings.items()) or "every default"
    peak = f", peak reserved {data['peak_reserved_mib']:,.0f} MiB" if "peak_reserved_mib" in data else ""
    steps = ", ".join(f"step {k}: {v} ({_psnr(data['worst_psnr'][k])})" for k, v in data["steps"].items())
    body = (f"`audit.run({shown})` on {device.type} ({data['threads']} CPU threads): {wall:.1f} s{peak}; programs "
            f"{data['programs']['built']} built, {data['programs']['reused']} reused; verdict "
            f"**{data['overall']}**; {steps}.")
    return body, data


def _psnr(value: Optional[float]) -> str:
    return "no PSNR" if value is None else f"{value:.2f} dB"


def sweep_memory(device: torch.device) -> Tuple[str, Dict[str, Any]]:
    """:data:`SWEEP_GRID` swept twice, each into a fresh folder: per pass its wall time, programs
    built and reused, reserved memory after it and its peak (CUDA), and the cells' verdicts."""
    import audit
    from attacks import capture

    passes = []
    for _ in range(2):
        before = dict(capture.STATS)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            report = audit.sweep(SWEEP_GRID, out=out, device=str(device), progress=False,
                                 **{**SWEEP_SETTINGS, **AUDIT_OVERRIDES})
            _sync(device)
            row = {"wall_s": round(time.perf_counter() - start, 2), "programs": _programs(before),
                   "verdicts": {c["name"]: c["verdict"] for c in report.cells}}
        if device.type == "cuda":
            row.update(reserved_mib=_mib(torch.cuda.memory_reserved(device)),
                       peak_reserved_mib=_mib(torch.cuda.max_memory_reserved(device)))
        passes.append(row)
    data = {"grid": SWEEP_GRID, "settings": {**SWEEP_SETTINGS, **AUDIT_OVERRIDES}, "passes": passes}
    lines = ["| pass | wall s | programs built | reused | reserved after, MiB | peak reserved, MiB | verdicts |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for i, row in enumerate(passes, 1):
        lines.append(f"| {i} | {row['wall_s']:.1f} | {row['programs']['built']} | {row['programs']['reused']} | "
                     f"{row.get('reserved_mib', 'n/a')} | {row.get('peak_reserved_mib', 'n/a')} | "
                     + ", ".join(f"{k}: {v}" for k, v in row["verdicts"].items()) + " |")
    first, second = passes
    if "reserved_mib" in first:
        growth = second["reserved_mib"] - first["reserved_mib"]
        lines.append(f"\nReserved memory from the first pass's end to the second's: {growth:+,.1f} MiB "
                     f"({'no growth' if growth <= 0 else 'grows'}).")
    same = first["verdicts"] == second["verdicts"]
    lines.append(f"{'' if 'reserved_mib' in first else chr(10)}Verdicts of the two passes: "
                 f"{'identical' if same else 'differ'}.")
    return f"`audit.sweep({SWEEP_GRID})` on {device.type}, twice:\n\n" + "\n".join(lines), data


def compare(first: Dict[str, Any], second: Dict[str, Any]) -> str:
    """Two stored audit sections side by side: the wall-time ratio and whether the verdicts agree."""
    same = (first["overall"], first["steps"]) == (second["overall"], second["steps"])
    differ = [k for k in first["steps"] if first["steps"][k] != second["steps"].get(k)]
    return (f"{second['wall_s']:.1f} s / {first['wall_s']:.1f} s = **{second['wall_s'] / first['wall_s']:.1f}x** "
            f"({second['threads']} CPU threads on the CPU, {first['threads']} beside the GPU); verdicts "
            + ("**identical** (overall and every step)." if same else
               f"**differ** (overall {first['overall']} / {second['overall']}; steps {', '.join(differ) or 'none'})."))


#: section bodies computed here (the others by bench_throughput.py): name -> body(device)
BODIES: Dict[str, Callable[[torch.device], Tuple[str, Dict[str, Any]]]] = {
    "audit-cuda": lambda device: default_audit(device, "demo"),
    "audit-cpu": lambda device: default_audit(device, "demo"),
    "audit-cuda-8": lambda device: default_audit(device, "default"),
    "sweep": sweep_memory,
    "paper": lambda device: (paper_audit(device), {}),
}


def in_own_process(name: str, device: torch.device, timeout: float = SECTION_TIMEOUT_S) -> Result:
    """One section computed by ``bench_throughput.py --gpu-turn-section name`` in a process of its
    own (on the section's device, with its threads): a fault that poisons the CUDA context (an
    illegal address) or a hang costs that section alone."""
    section = SECTIONS[name]
    where = str(device) if section.device == "cuda" else "cpu"
    command = [sys.executable, "-m", "bench.bench_throughput", "--device", where,
               "--threads", str(section.threads), "--gpu-turn-section", name]
    stdout, stderr, code = _run(command, timeout)
    if code is None:
        return f"failed: stopped after {timeout:.0f} s", {}, False
    if code == 0 and BODY in stdout:
        result = json.loads(stdout.split(BODY, 1)[1].strip())
        return result["body"], result["data"], True
    return _failed(code, stderr), {}, False


def _failed(code: Optional[int], output: str, note: str = "") -> str:
    """A section's failure: its exit code and the last lines it printed."""
    tail = "\n".join(output.strip().splitlines()[-30:])
    return f"failed (exit {code}{note}):\n\n```\n{tail}\n```"


def in_this_process(name: str, device: torch.device, timeout: float = SECTION_TIMEOUT_S) -> Result:
    """One of :data:`BODIES` computed here (no timeout: for tests of the turn's plumbing)."""
    section = SECTIONS[name]
    body, data = BODIES[name](device if section.device == "cuda" else torch.device("cpu"))
    return body, data, True


def papers_slices(folder: Path, seconds: float) -> Result:
    """The papers' gpu profile for ``seconds`` (``python -m bench.papers --call-minutes``), its results
    in ``folder / PAPERS_DIR``, seeded from the committed ones the first time: every slice it
    finishes is kept there, and a later turn goes on from it. Copy that folder's store
    (``results.jsonl``) and ``gpu-embedded`` back into ``bench/results/papers/`` and commit them."""
    results = folder / PAPERS_DIR
    committed = ROOT / "bench" / "results" / "papers"
    if not (results / FILE).exists() and (committed / FILE).is_file():
        results.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(committed / FILE, results / FILE)
        if (committed / "gpu-embedded").is_dir():
            shutil.copytree(committed / "gpu-embedded", results / "gpu-embedded")
    minutes = max(0.0, seconds - PAPERS_MARGIN_S) / 60
    command = [sys.executable, "-m", "bench.papers", "--profile", "gpu",
               "--call-minutes", f"{minutes:.1f}", "--results", str(results)]
    stdout, stderr, code = _run(command, seconds)
    lines = [line for line in stdout.splitlines() if "slices run in" in line or " left, ~" in line]
    if code != 0:
        return _failed(code, stderr or stdout, "; its finished slices are kept"), {}, False
    return ("; ".join(lines[-1:]) or "no slice left") + f" (results: {results})", {"minutes": minutes}, True


def _section(name: str, device: torch.device, timeout: float, spawn: Callable[..., Result]) -> Result:
    if name == "tests":
        body, ok = cuda_tests(timeout)
        return body, {}, ok
    return spawn(name, device, timeout)


def kept(folder: Path) -> Dict[str, Dict[str, Any]]:
    """The section results stored in ``folder`` (a section that ran to its end), by name."""
    out = {}
    for name in (n for n in SECTIONS if n != REPEATED):
        path = folder / f"{name}.json"
        if path.is_file():
            out[name] = json.loads(path.read_text())
    return out


def _keep(folder: Path, name: str, result: Dict[str, Any]) -> None:
    """Write one section's result whole or not at all (a stopped call leaves no half file)."""
    path = folder / f"{name}.json"
    part = path.with_suffix(".json.part")
    part.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(part, path)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} (no GPU)"


def page(device: torch.device, results: Dict[str, Dict[str, Any]], waiting: Dict[str, str]) -> str:
    """The turn's Markdown: each section's kept or failed result, or why it waits."""
    parts = [f"# A GPU turn\n\n`python -m bench.bench_throughput --device cuda --gpu-turn` (torch "
             f"{torch.__version__}, {_device_name(device)}); sections kept under the turn's folder, a later turn "
             "runs the rest."]
    first, second = (results.get(n) for n in COMPARED)
    if first and second and first.get("ok") and second.get("ok"):
        parts.append(f"## The default audit: CPU / CUDA wall time\n\n"
                     f"{SECTIONS[COMPARED[1]].title} / {SECTIONS[COMPARED[0]].title}: "
                     f"{compare(first['data'], second['data'])}")
    for name, section in SECTIONS.items():
        if name in results:
            r = results[name]
            parts.append(f"## {section.title}\n\n{r['body']}\n\n({r['seconds']:.0f} s)")
        elif name in waiting:
            parts.append(f"## {section.title}\n\nNot run yet: {waiting[name]}.")
    return "\n\n".join(parts) + "\n"


def run(device: torch.device, out: Path, folder: Path, budget_s: float = TURN_BUDGET_S,
        only: Optional[Sequence[str]] = None, spawn: Callable[..., Result] = in_own_process) -> Path:
    """Every section of :data:`SECTIONS` (or ``only`` those) not kept in ``folder`` yet, in turn,
    while its estimate fits what is left of ``budget_s``; each one's result is kept in ``folder``
    as it finishes, and the page ``out`` rewritten."""
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = kept(folder)
    waiting: Dict[str, str] = {}
    for name, section in SECTIONS.items():
        if name in results or (only is not None and name not in only):
            continue
        left = budget_s - (time.perf_counter() - start)
        if left < section.estimate_s:
            waiting[name] = (f"about {section.estimate_s:.0f} s, {max(0.0, left):.0f} s of this turn's "
                             f"{budget_s:.0f} s were left; the next turn with the same folder runs it")
            continue
        began = time.perf_counter()
        if name == REPEATED:  # every turn with time left moves the papers' profile on
            body, data, ok = papers_slices(folder, left)
        else:
            body, data, ok = _section(name, device, min(SECTION_TIMEOUT_S, left), spawn)
        results[name] = {"title": section.title, "body": body, "data": data, "ok": ok,
                         "seconds": round(time.perf_counter() - began, 1)}
        if ok and name != REPEATED:
            _keep(folder, name, results[name])
        print(f"## {section.title}\n\n{body}", flush=True)
        out.write_text(page(device, results, waiting))  # a turn cut short keeps its finished sections
    out.write_text(page(device, results, waiting) + f"\nThis turn: {time.perf_counter() - start:.0f} s.\n")
    return out
