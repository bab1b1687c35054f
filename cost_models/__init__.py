"""Every price, installed as ``autopar.cost_models``: pure functions from a captured model's
annotations, a cluster and a candidate decision to seconds and bytes (units in the names,
formula and source in each docstring). The planner, ``autopar estimate`` and every benchmark
price through them.
"""
