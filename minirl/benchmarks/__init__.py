"""Benchmarks, written as JSON (`minirl bench WHAT`, `dispatch.py`). Speed is compared as ratios measured side by
side in one run. `import minirl` loads none of it."""
from minirl.benchmarks.dispatch import BENCHMARKS, SIZES, run

__all__ = ["BENCHMARKS", "SIZES", "run"]
