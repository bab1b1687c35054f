"""The ``autopar`` command line: ``plan``, ``estimate``, ``inspect``, ``verify``, ``profile``,
``profile-comm``, ``calibrate``, ``replan``, ``export``, ``report``, ``dryrun``, ``models``, ``clusters``.
One module per command family (``plan``, ``verify``, ``report``, ``estimate``: inspect and
estimate, ``profile``: profile, profile-comm and calibrate, ``checkpoint``: replan and export);
this one builds the parser and dispatches.

Exit codes: 0 success, 2 user error (one line on stderr, no traceback), 1 bug.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

from autopar.cli import checkpoint, dryrun, estimate, plan, profile, report, verify
from autopar.cli.common import add_json_flag, count, print_json
from autopar.errors import AutoparError
from autopar.units import format_bytes, format_si


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (``autopar plan: error: …``) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="Plan and run parallel training for a PyTorch model.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    estimate.add_parsers(sub)  # inspect, estimate
    plan.add_parser(sub)
    verify.add_parser(sub)
    dryrun.add_parser(sub)
    profile.add_parsers(sub)  # profile, profile-comm, calibrate
    checkpoint.add_parsers(sub)  # replan, export
    report.add_parser(sub)
    add_json_flag(sub.add_parser("models", help="list the built-in models"))
    add_json_flag(sub.add_parser("clusters", help="list the built-in cluster presets"))
    return parser


def cmd_models(args: argparse.Namespace, console: Console) -> None:
    from autopar.zoo import ZOO, build

    rows: list[dict[str, Any]] = []
    for name, entry in ZOO.items():
        params = sum(p.numel() for p in build(name).parameters())
        rows.append(
            {
                "name": name,
                "family": entry.family,
                "params": params,
                "default_seq": entry.default_seq,
                "source": entry.source,
            }
        )
    if args.json:
        print_json(rows)
        return
    table = Table(show_edge=False)
    for col in ("model", "family", "params", "seq", "shape from"):
        table.add_column(col, justify="right" if col in ("params", "seq") else "left")
    for r in rows:
        table.add_row(r["name"], r["family"], count(r["params"]), str(r["default_seq"]), r["source"])
    console.print(table)


def cmd_clusters(args: argparse.Namespace, console: Console) -> None:
    from autopar.cluster import Cluster, preset_names

    clusters = [Cluster.preset(name) for name in preset_names()]
    if args.json:
        print_json([c.to_dict() for c in clusters])
        return
    table = Table(show_edge=False)
    for col in (
        "preset",
        "device",
        "per node",
        "memory",
        "bf16 peak",
        "HBM",
        "intra-node",
        "inter-node/node",
    ):
        table.add_column(col, justify="left" if col in ("preset", "device") else "right")
    for c in clusters:
        d = c.device
        table.add_row(
            c.name,
            d.name,
            str(c.gpus_per_node),
            format_bytes(d.memory_bytes),
            format_si(d.peak_flops["bf16"], "FLOP/s"),
            format_si(d.hbm_bandwidth_bytes_per_s, "B/s"),
            format_si(c.intra_node.bandwidth_bytes_per_s, "B/s"),
            format_si(c.inter_node.bandwidth_bytes_per_s, "B/s"),
        )
    console.print(table)
    console.print("[dim]use with --nodes N; or write a YAML file (see README)[/dim]")


COMMANDS: dict[str, Any] = {
    "plan": plan.cmd_plan,
    "inspect": estimate.cmd_inspect,
    "estimate": estimate.cmd_estimate,
    "verify": verify.cmd_verify,
    "dryrun": dryrun.cmd_dryrun,
    "profile": profile.cmd_profile,
    "profile-comm": profile.cmd_profile_comm,
    "calibrate": profile.cmd_calibrate,
    "replan": checkpoint.cmd_replan,
    "export": checkpoint.cmd_export,
    "report": report.cmd_report,
    "models": cmd_models,
    "clusters": cmd_clusters,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Wide enough for the tables when piped; a terminal sets its own width.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
    try:
        COMMANDS[args.command](args, console)
    except AutoparError as e:
        print(f"autopar {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


PLANNING_ONLY = frozenset({"plan", "inspect", "estimate", "models", "clusters"})
"""Commands that capture and price but never train: run without the cycle collector (``run``)."""


def run() -> NoReturn:
    """The ``autopar`` console script and ``python -m autopar``: one command in a fresh process
    that exits after it (``main`` is the same command for a caller that goes on).

    A command in ``PLANNING_ONLY`` runs without the cycle collector: importing torch and
    torch._dynamo (which capture imports) leaves ~283 k objects that live until exit, and each
    full collection walked them all, while the command's cyclic garbage (fx graphs of its
    captures) is ~10 MB (peak RSS 376 → 386 MB planning GPT-3 175B). At exit what is left is
    frozen (``gc.freeze``), so the interpreter's final collection has nothing to walk either.
    Measured on the 2-core machine, ``autopar plan gpt3-175b --cluster dgx-a100-80g --nodes 128
    --global-batch 1536`` with an empty capture cache: 5.3–5.6 s wall with the collector, 3.9–4.2 s
    without (``benchmarks/plan_speed.py`` gives today's figures). Commands that train keep it.
    """
    argv = sys.argv[1:]
    planning = bool(argv) and argv[0] in PLANNING_ONLY
    if planning:
        gc.disable()
    code = main(argv)
    if planning:
        gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
