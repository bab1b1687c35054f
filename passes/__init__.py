"""Graph rewrites by a Plan, installed as ``autopar.passes``: the tensor-parallel rewrite and
its sharding rules, the pipeline split and block outlining, recomputation. A pass takes a
captured graph (or module) and the Plan and returns what it rewrote; it never calls the planner.
One pass family per file.
"""
