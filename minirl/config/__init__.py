"""The run configuration (`fields.py`: the one dataclass and its field docstrings), its checks (`validate.py`) and
its conversions (`io.py`: types, YAML; `cli.py`: CLI flags and the field docs)."""
from minirl.config.cli import add_cli_args, dashed, field_docs, field_sections, overrides_from_args
from minirl.config.errors import ConfigError
from minirl.config.fields import Config
from minirl.config.presets import DEMO
from minirl.config.validate import parse_cores

__all__ = ["Config", "ConfigError", "DEMO", "add_cli_args", "dashed", "field_docs", "field_sections",
           "overrides_from_args", "parse_cores"]
