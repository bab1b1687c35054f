"""Graph-rewriting passes, installed as ``autopar.passes``.

Each pass is a function ``pass(gm_or_module, plan, ...) -> rewritten`` that
consumes a ``Plan`` and never calls the planner. One pass family per file.
The tensor-parallel, pipeline-split and recompute passes land here with the
issues that need them; capture-time analysis lives in ``autopar.graph``.
"""
