"""The planner: a ``PlanRequest`` in, the fastest predicted ``Plan`` that fits out (it solves,
never rewrites).

    profiles.py    the model's cost profiles at every micro-batch (two captures)
    pricing.py     one strategy's estimate, TP priced by its per-operator choice
    search.py      outer knobs enumerated, branch and bound over their lower bounds
    layout_ilp.py  blocks and recompute per pipeline rank (an ILP over counts)
    tp_ilp.py      one strategy per operator of a layer (Alpa-style ILP)
    tp_layouts.py  what the per-operator choice means for the whole model and the Plan
    assemble.py    search → Plan, runners-up and hand baselines
"""

from autopar.planner.assemble import PlanResult, make_plan
from autopar.planner.pricing import Pricer
from autopar.planner.profiles import ModelProfiles

__all__ = ["ModelProfiles", "PlanResult", "Pricer", "make_plan"]
