"""minirl: asynchronous RL fine-tuning of small LLMs with LoRA on one machine."""
from .config import Config, ConfigError
from .rewards import REGISTRY, Scorer, reward
from .run import Run

__all__ = ["Config", "ConfigError", "Run", "Scorer", "reward", "REGISTRY"]
__version__ = "0.1.0"
