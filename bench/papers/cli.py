"""The command line of the papers bench (``python -m bench.papers``): run the rows, write
the page, or (``--render``) write the page from the stored cells alone."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bench.docs_table import ROOT, add_docs_option, command_line, with_table, without_options, write_table
from bench.papers import __doc__ as PACKAGE_DOC
from bench.papers.cells import Profile
from bench.papers.gpu import call_summary, gpu_call_help, gpu_plan, plan_table, slices_left
from bench.papers.render import DETAILS_PAGE, render, render_parts, timing
from bench.papers.rows import BY_ID, ROWS
from bench.papers.run import run_rows
from bench.papers.slices import GPU_CALL_MINUTES, Deadline
from bench.papers.spec import PAPERS, PROFILES, QUICK, Row
from bench.papers.store import RESULTS

#: the page the verdict table is written into (each row's details go to ``DETAILS_PAGE``)
PAGE = "docs/papers.md"


def selected(rows: Optional[Sequence[str]], papers: Optional[Sequence[str]], profile: str) -> List[Row]:
    return [r for r in ROWS if profile in r.profiles and (not rows or r.id in rows)
            and (not papers or r.paper in papers)]


def page_command(argv: Optional[Sequence[str]]) -> List[str]:
    """The arguments of the command that writes the whole page: the given ones without
    ``--render``, the row filters and the per-invocation limits."""
    return without_options(argv, valued=("--rows", "--paper", "--call-minutes"), flags=("--render", "--retry"))


def require_lpips() -> None:
    """The committed cells rank each image's candidates by LPIPS: without its weights the engine
    keys its runs by another similarity and every kept slice would run again, so stop first."""
    from audit.core.metrics import MetricUnavailable, lpips_model

    try:
        lpips_model("cpu")
    except MetricUnavailable as err:
        raise SystemExit(f"the committed cells identify images by LPIPS, unavailable here ({err}): run `make weights` "
                         "(or `gia-audit weights lpips`) first, else every kept slice runs again under another "
                         "similarity")


def page_texts(argv: Optional[Sequence[str]], name: str, profile: Profile, data: str, data_args: Dict[str, Any],
               root: Path, out: Path, threads: Optional[int] = None, page: str = PAGE) -> Dict[Path, str]:
    """The texts of ``page`` and :data:`DETAILS_PAGE` with their section ``name`` written from the
    stored cells of every row of the profile, as the command ``argv`` writes them (``threads``:
    those of a run; a render runs nothing and names none). Writes nothing."""
    import torch

    rows = selected(None, None, profile.name)  # the page shows every row of the profile
    table, details = render_parts(rows, profile, data, data_args, root, out)
    ran = "" if threads is None else f"{threads} thread(s), "
    setting = f"torch {torch.__version__}, {ran}{profile.device}; {timing(rows, profile, data, data_args, root, out)}"
    command = command_line("bench.papers", page_command(argv))
    return dict(with_table(where, name, command, text, setting) for where, text in ((page, table),
                                                                                   (DETAILS_PAGE, details)))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=PACKAGE_DOC.split("\n")[0], epilog=gpu_call_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="cpu")
    parser.add_argument("--images", type=int, default=None, help="private images per cell (default: the row's)")
    parser.add_argument("--rows", action="append", choices=list(BY_ID), help="run only these rows")
    parser.add_argument("--paper", action="append", choices=list(PAPERS), help="run only this paper's rows")
    parser.add_argument("--data-path", default=None, help="a local CIFAR-10 (python pickle format)")
    parser.add_argument("--device", default=None, help="default: cuda for the gpu profile, else cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--call-minutes", type=float, default=GPU_CALL_MINUTES,
                        help="gpu profile: start a slice only while its planned minutes fit what is left of these "
                             f"(default {GPU_CALL_MINUTES:g}: one lent call; 8 in the one-call command below)")
    parser.add_argument("--out", default=str(ROOT / "bench-out" / "papers"), help="the engine's result stores")
    parser.add_argument("--results", default=None, help=f"the persisted cells (default {RESULTS})")
    parser.add_argument("--retry", action="store_true",
                        help="rerun stored cells with missing evidence or no positive control")
    parser.add_argument("--tiny", action="store_true", help="with --profile gpu: its rows and width-64 models at the "
                        "quick check's budgets (2 images, 4 evaluations), results under --out, never the page")
    parser.add_argument("--render", action="store_true", help="write the page from stored results; run nothing")
    parser.add_argument("--plan", action="store_true", help="print the slices left, their planned GPU minutes and "
                        "the calls they need")
    add_docs_option(parser, PAGE)
    args = parser.parse_args(argv)
    deadline = Deadline(args.call_minutes) if args.profile == "gpu" else None

    import torch

    torch.set_num_threads(args.threads)
    name = args.profile
    device = args.device or ("cuda" if name == "gpu" and not args.tiny else "cpu")
    if args.tiny and name != "gpu":
        raise SystemExit("--tiny checks the gpu profile on a CPU: use it with --profile gpu (the cpu profile's "
                         "own check is --profile quick)")
    profile = Profile(name, args.images or (QUICK["images"] if name == "quick" or args.tiny else None), device,
                      tiny=args.tiny)
    data, data_args = ("cifar10", {"path": args.data_path}) if args.data_path else ("embedded", {})
    out = Path(args.out)
    root = Path(args.results) if args.results else (out / "results" if profile.shrunk else RESULTS)
    rows = selected(args.rows, args.paper, name)
    if args.plan:
        left = slices_left(rows, profile, data, data_args, root, out, args.retry)
        print(gpu_plan(left))
        if args.docs:  # the plan on the page, until a GPU runs it
            write_table(args.docs_page, args.docs, command_line("bench.papers", page_command(argv)), plan_table(left))
        return

    def publish() -> None:
        if args.docs and not profile.shrunk:
            threads = None if args.render else args.threads
            for path, text in page_texts(argv, args.docs, profile, data, data_args, root, out, threads,
                                         args.docs_page).items():
                path.write_text(text)

    if not args.render and not profile.shrunk:
        require_lpips()
    over = None if args.render else run_rows(rows, profile, data, data_args, out, root, args.retry, deadline, publish)
    print(render(rows, profile, data, data_args, root, out))
    publish()
    print(f"results: {root}")
    if deadline is not None and not args.render:
        print(call_summary(deadline, over, slices_left(rows, profile, data, data_args, root, out, args.retry)))

