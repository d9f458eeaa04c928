import dataclasses

from minirl import Config
from minirl.config import add_cli_args, field_docs, overrides_from_args


def test_every_field_has_a_docstring():
    docs = field_docs()
    missing = [f.name for f in dataclasses.fields(Config) if not docs.get(f.name)]
    assert not missing


def test_yaml_round_trip(tmp_path):
    c = Config(steps=7, target_modules=["q_proj", "v_proj"], tis_cap=None, reward_weights=[0.5])
    c.to_yaml(tmp_path / "c.yaml")
    assert Config.from_yaml(tmp_path / "c.yaml") == c


def test_cli_flags_parse_as_yaml_values():
    import argparse
    p = argparse.ArgumentParser()
    add_cli_args(p)
    ns = p.parse_args(["--steps", "5", "--target-modules", "[q_proj,v_proj]", "--tis-cap", "null", "--lr", "1e-3"])
    ov = overrides_from_args(ns)
    assert ov == {"steps": 5, "target_modules": ["q_proj", "v_proj"], "tis_cap": None, "lr": 1e-3}
    assert Config(**ov).steps == 5


def test_every_cli_help_prints(capsys):
    """`minirl <command> --help` lists the Config flags (a '%' in a field's docstring once crashed argparse)."""
    import pytest
    from minirl.cli import main
    for cmd in ("demo", "train", "eval", "bench"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "usage: minirl" in capsys.readouterr().out
