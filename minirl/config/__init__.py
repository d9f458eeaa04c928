"""The run configuration (`fields.py`: the one dataclass and its field docstrings), its checks (`validate.py`) and
its conversions (`io.py`: types, YAML; `cli.py`: CLI flags and the field docs)."""
from .errors import ConfigError
from .fields import DEMO, Config
from .cli import add_cli_args, field_docs, overrides_from_args
from .validate import parse_cores

__all__ = ["Config", "ConfigError", "DEMO", "add_cli_args", "field_docs", "overrides_from_args", "parse_cores"]
