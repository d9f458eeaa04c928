"""The run: `Run` is the lifecycle and the loop (`loop.py`); where each side runs and K (`placement.py`), the
memory plan of each device (`plan.py`), the parts built from the config (`build.py`), out_dir (`folder.py`),
checkpoints (`checkpoint.py`), the background thread (`background.py`), held-out evaluation (`evaluation.py`),
two runs' evaluations paired problem by problem (`compare.py`), trackers (`trackers.py`) and the merged export
(`export.py`)."""
from minirl.run.compare import Comparison, compare
from minirl.run.loop import Run

__all__ = ["Comparison", "Run", "compare"]
