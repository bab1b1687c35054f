"""``autopar replan`` (the plan a restart on another cluster would take, next to the checkpoint's)
and ``autopar export`` (a checkpoint as a torch state dict or a Hugging Face folder)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from autopar.cli.common import CLUSTER_HELP, MODEL_HELP, add_json_flag, positive, print_json, progress
from autopar.errors import AutoparError
from autopar.plan import Plan

KNOBS = ("tp", "pp", "dp", "zero", "micro_batch", "schedule", "virtual_stages", "sequence_parallel")
"""The strategy fields a re-plan may change, in the order they are reported."""


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("replan", help="the plan a restart on another cluster takes, and the checkpoint's")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a Checkpointer directory")
    p.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    p.add_argument("--nodes", type=positive, default=None, help="number of nodes (default 1)")
    p.add_argument(
        "--gpus-per-node", type=positive, default=None, help="GPUs per node (default: the cluster's)"
    )
    add_json_flag(p, "text")
    p = sub.add_parser("export", help="write a checkpoint's weights as a torch state dict or a HF folder")
    p.add_argument("checkpoint", metavar="DIR", help="a checkpoint folder or a Checkpointer directory")
    p.add_argument("--to", choices=("torch", "hf"), required=True, help="torch: torch.save file; hf: folder")
    p.add_argument("out", metavar="OUT", help="the file (torch) or folder (hf) to write")
    p.add_argument(
        "--model", default=None, help=f"for --to hf: the model ({MODEL_HELP}); default: the plan's"
    )
    add_json_flag(p, "text")


def changes(old: Plan, new: Plan) -> dict[str, list[Any]]:
    """{knob: [old value, new value]} for every strategy knob the re-plan changed."""
    a, b = old.strategy, new.strategy
    return {k: [getattr(a, k), getattr(b, k)] for k in KNOBS if getattr(a, k) != getattr(b, k)}


def cmd_replan(args: argparse.Namespace, console: Console) -> None:
    from autopar.groups import load_one_type
    from autopar.planner import make_plan
    from autopar.request import Constraints, PlanRequest
    from autopar.runtime.checkpoint import saved_plan, trainer_state
    from autopar.runtime.export import checkpoint_folder

    folder = checkpoint_folder(args.checkpoint)
    old = saved_plan(folder)
    if old is None:
        raise AutoparError(f"the checkpoint {str(folder)!r} was saved without its plan (by plain DCP)")
    st = old.strategy
    cluster = load_one_type(
        args.cluster, what="autopar replan", nodes=args.nodes, gpus_per_node=args.gpus_per_node
    )
    progress(args, f"planning {args.model} for {cluster.world_size} GPUs …")
    request = PlanRequest(
        model=args.model,
        cluster=cluster,
        global_batch=st.global_batch,
        seq=st.seq,
        dtype=st.dtype,
        constraints=Constraints(compile=st.compile),  # the run compiles its blocks or not, as before
    )
    new = make_plan(request).plan
    step = trainer_state(folder).get("step")
    diff = changes(old, new)
    if args.json:
        print_json(
            {
                "checkpoint": str(folder),
                "step": step,
                "old": old.to_dict(),
                "new": new.to_dict(),
                "changes": diff,
            }
        )
        return
    console.print(f"checkpoint {folder} (step {step}), saved under {old.strategy.world_size} GPUs:")
    console.print("  " + "\n  ".join(old.text().splitlines()[:2]))
    console.print(f"a restart on {cluster.world_size} GPUs ({cluster.name}) takes:")
    console.print("  " + "\n  ".join(new.text().splitlines()[:2]))
    said = ", ".join(f"{k} {a}→{b}" for k, (a, b) in diff.items()) or "nothing"
    console.print(
        f"changes: {said}; the checkpoint loads resharded into it (same global batch and data order)"
    )


def cmd_export(args: argparse.Namespace, console: Console) -> None:
    from autopar.runtime.export import export_checkpoint

    if args.model and args.to != "hf":
        raise AutoparError("--model is for --to hf (a torch state dict needs no model)")
    folder = export_checkpoint(args.checkpoint, args.out, to=args.to, model=args.model)
    if args.json:
        print_json({"checkpoint": str(folder), "out": args.out, "format": args.to})
        return
    console.print(f"wrote {args.out} ({args.to}) from {folder}")


__all__ = ["add_parsers", "changes", "cmd_export", "cmd_replan"]
