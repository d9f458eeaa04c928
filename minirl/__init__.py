"""minirl: asynchronous RL fine-tuning of small LLMs with LoRA on one machine."""
from minirl.core import quiet  # noqa: F401 - first: silences a bitsandbytes warning (see core/quiet.py)

# isort: split
from minirl import sandbox
from minirl.config import Config, ConfigError
from minirl.generation.envs import Env, EnvStep, tool, tools
from minirl.rewards import REGISTRY, Scorer, reward
from minirl.run import Run, compare
from minirl.run.plan import plan
from minirl.ui import Dashboard, check, doctor, preview, preview_episodes, render, rescore, xray
from minirl.ui import render as plot  # minirl.plot(out_dir or metrics.jsonl): the dashboard's panels from a saved run

__all__ = ["Config", "ConfigError", "Run", "Scorer", "reward", "REGISTRY", "Dashboard", "doctor", "render", "plot",
           "check", "preview", "rescore", "sandbox", "Env", "EnvStep", "tool", "tools",
           "preview_episodes", "plan", "compare", "xray"]
__version__ = "0.1.0"
