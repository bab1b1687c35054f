"""``python -m autopar`` runs the CLI."""

from autopar.cli import run

run()
