"""Cost models, installed as ``autopar.cost_models``: pure functions, units in names.

``closed_forms`` holds the published formulas (model size, FLOPs, activation
memory) that captured numbers are checked against. Compute, memory and
communication models land here with the cost-model issue.
"""
