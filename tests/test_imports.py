"""'module:function' references: a module that fails while importing is one line naming the reference and the
error; the working folder is searched after site-packages and only while importing, so a file there named like
an installed package (a decoy `cloudpickle.py`) is never the one imported."""
import subprocess
import sys

import pytest

from minirl.rewards import resolve_reward

FAULTS = {  # module source -> what the line must say
    "def f(p, c:\n    return 1\n": "SyntaxError",
    "x = undefined_name\n": "NameError: name 'undefined_name' is not defined",
    "x = {}['missing']\n": "KeyError: 'missing'",
    "raise RuntimeError('no GPU here\\nsecond line')\n": "RuntimeError: no GPU here second line",
}


@pytest.mark.parametrize("source", list(FAULTS), ids=["syntax", "name", "key", "runtime"])
def test_a_reward_module_failing_on_import_is_one_line_naming_the_reward(tmp_path, monkeypatch, source):
    mod = f"wt_badrew_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{mod}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        resolve_reward(f"{mod}:score")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"reward '{mod}:score': importing module '{mod}' raised ") and \
        FAULTS[source] in msg, msg
    assert e.value.__cause__ is None and e.value.__suppress_context__


DECOY = "import pathlib\npathlib.Path('DECOY_RAN').write_text('yes')\nraise SystemExit('decoy cloudpickle imported')\n"
SCRIPT = """
import importlib.machinery, os, sys
from minirl.cli import main
assert main(["train", "missing.yaml"]) == 2          # the CLI's start-up leaves sys.path alone
from minirl.rewards import resolve_reward
name, fn = resolve_reward("wt_goodrew:score")       # found in the working folder...
assert fn("p", "c") == 1.0
assert os.getcwd() not in sys.path                  # ...which is on sys.path only while importing
spec = importlib.machinery.PathFinder.find_spec("cloudpickle")
print("CLOUDPICKLE", spec.origin)
import cloudpickle
cloudpickle.dumps(fn)
print("OK")
"""


def test_a_decoy_module_in_the_working_folder_never_shadows_an_installed_one(tmp_path):
    """`-P`: no working folder on sys.path at start, as for the installed `minirl` script."""
    (tmp_path / "cloudpickle.py").write_text(DECOY)
    (tmp_path / "wt_goodrew.py").write_text("import json\n\ndef score(prompt, completion, **_):\n    return 1.0\n")
    p = subprocess.run([sys.executable, "-P", "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr[-2000:]
    assert not (tmp_path / "DECOY_RAN").exists()
    origin = p.stdout.split("CLOUDPICKLE ")[1].split()[0]
    assert not origin.startswith(str(tmp_path)), origin
