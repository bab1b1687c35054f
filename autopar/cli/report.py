"""``autopar report``: a plan, and optionally a run's metrics, as one self-contained HTML page
(``monitor.report``), with the figures as PNG files too on ``--png``."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rich.console import Console

from autopar.cli.common import add_json_flag, print_json, read_plan, spinner
from autopar.errors import AutoparError
from autopar.files import check_writable, write_atomic


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="a plan (and a run's metrics) as one self-contained HTML page")
    p.add_argument("plan", metavar="PLAN", help="a plan file (autopar plan --out, or its --json output)")
    p.add_argument("--out", required=True, help="the HTML file to write")
    p.add_argument("--metrics", default=None, help="a run's metrics JSONL (autopar.Metrics(jsonl=…))")
    p.add_argument(
        "--dryrun",
        default=None,
        help="the plan's dry run (autopar dryrun --plan PLAN --json > FILE), beside the memory",
    )
    p.add_argument("--png", action="store_true", help="also write each figure as OUT-NAME.png beside it")
    add_json_flag(p, "text")


def png_paths(out: str, names: list[str]) -> dict[str, str]:
    """``report.html`` → ``report-timeline.png``, … beside it."""
    stem = os.path.splitext(out)[0]
    return {name: f"{stem}-{name}.png" for name in names}


def cmd_report(args: argparse.Namespace, console: Console) -> None:
    from autopar.monitor.metrics import read_jsonl
    from autopar.monitor.report import report_html

    check_writable(args.out)
    plan = read_plan(args.plan)
    metrics = None
    if args.metrics:
        try:
            metrics = read_jsonl(args.metrics)
        except (OSError, ValueError) as e:
            raise AutoparError(f"can't read metrics {args.metrics!r}: {e}") from None
    dryrun = read_dryrun(args.dryrun, plan) if args.dryrun else None
    with spinner(args, "drawing …"):
        page, pngs = report_html(plan, metrics=metrics, dryrun=dryrun, with_png=args.png)
    paths = png_paths(args.out, list(pngs))
    for name, data in pngs.items():
        write_atomic(paths[name], data)
    write_atomic(args.out, page)
    if args.json:
        print_json({"out": args.out, "png": list(paths.values()), "bytes": len(page.encode())})
        return
    console.print(
        f"wrote {args.out} ({len(page.encode()) / 1024:.0f} KiB)" + "".join(f", {p}" for p in paths.values())
    )


def read_dryrun(path: str, plan: Any) -> list[dict[str, Any]]:
    """The ranks of ``autopar dryrun --json`` (or ``plan --check --json``'s ``check``) for ``plan``:
    one line naming the file and the fix where it is not that, or is another plan's."""
    from autopar.plan import Plan

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise AutoparError(f"can't read the dry run {path!r}: {e}") from None
    ranks = data.get("ranks", data.get("check")) if isinstance(data, dict) else None
    if not isinstance(ranks, list) or not all(isinstance(r, dict) and "peak_bytes" in r for r in ranks):
        raise AutoparError(
            f"{path}: not a dry run; write one with `autopar dryrun --plan PLAN --json > {path}`"
        )
    if "plan" in data and Plan.from_dict(data["plan"]).hash != plan.hash:
        raise AutoparError(
            f"{path} is the dry run of another plan; dry-run this one: `autopar dryrun --plan PLAN --json`"
        )
    return ranks


__all__ = ["add_parser", "cmd_report", "png_paths", "read_dryrun"]
