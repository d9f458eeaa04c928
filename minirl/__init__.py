"""minirl: asynchronous RL fine-tuning of small LLMs with LoRA on one machine."""
import logging

# bitsandbytes (QLoRA), imported by transformers wherever it is installed, warns on every AVX512-bf16 CPU that its
# optional 4-bit kernel (a Hugging Face Hub download, out of reach offline) is missing; its built-in path runs.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from minirl import sandbox
from minirl.config import Config, ConfigError
from minirl.generation.envs import Env, EnvStep, tool, tools
from minirl.rewards import REGISTRY, Scorer, reward
from minirl.run import Run
from minirl.ui import Dashboard, check, doctor, preview, preview_episodes, render, rescore

plot = render  # minirl.plot(out_dir or metrics.jsonl): the dashboard's panels from a saved run

__all__ = ["Config", "ConfigError", "Run", "Scorer", "reward", "REGISTRY", "Dashboard", "doctor", "render", "plot",
           "check", "preview", "rescore", "sandbox", "Env", "EnvStep", "tool", "tools",
           "preview_episodes"]
__version__ = "0.1.0"
