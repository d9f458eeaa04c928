"""What a person looks at: the live dashboard widget (`dashboard.py`), its panels (`panels.py`), the doctor's
alerts (`doctor.py`), and the helpers to try reward functions before training (`prototype.py`)."""
from .dashboard import Dashboard, alerts_html, samples_html
from .doctor import Alert, doctor
from .panels import PANELS, figure, render
from .prototype import check, preview, rescore

__all__ = ["Alert", "Dashboard", "PANELS", "alerts_html", "check", "doctor", "figure", "preview", "render", "rescore",
           "samples_html"]
