"""What a person looks at: the live dashboard widget (`dashboard.py`), its panels (`panels.py`), the doctor's
alerts (`doctor.py`), a run read after the fact as a live one is (`saved.py`: both are a `types.RunView`), the
helpers to try reward functions before training (`prototype.py`), and episodes shown token by token with what the
loss trains on (`episodes.py`), and one logged completion token by token as the loss saw it (`xray.py`)."""
from minirl.ui.dashboard import Dashboard, alerts_html, samples_html
from minirl.ui.doctor import Alert, doctor
from minirl.ui.episodes import EpisodePreview, episode_html, preview_episodes
from minirl.ui.panels import PANELS, figure, render
from minirl.ui.prototype import check, preview, rescore
from minirl.ui.saved import SavedRun
from minirl.ui.xray import XrayView, xray

__all__ = ["Alert", "Dashboard", "EpisodePreview", "PANELS", "alerts_html", "check", "doctor", "episode_html",
           "figure", "preview", "preview_episodes", "render", "rescore", "samples_html", "SavedRun",
           "XrayView", "xray"]
