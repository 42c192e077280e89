"""hybrid_ray's benchmark suite: workloads, scenarios, baselines and reports.

Run it with ``hybrid-ray bench`` (or ``python -m benchmarks``); see ``suite.py``.
"""
