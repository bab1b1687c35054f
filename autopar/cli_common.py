"""Small helpers shared by the CLI's command modules."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console


def progress(args: argparse.Namespace, message: str) -> None:
    """A progress line on stderr, for people at a terminal (never in --json or piped runs)."""
    if not args.json and sys.stderr.isatty():
        Console(stderr=True).print(f"[dim]{message}[/dim]")


def count(n: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f}"
