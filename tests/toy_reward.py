"""Toy rewards of the tests (`yes_reward`: `toy_cfg`'s, tests/conftest.py) in a module that imports nothing: a
reward worker process imports the module a reward was defined in, and a test file's or conftest's imports (pytest,
minirl, hence torch) cost each worker of each run ~10 s of start-up on a loaded 2-core machine."""


def yes_reward(prompt, completion, **_):
    """Toy task for tiny models: did the completion say 'yes'?"""
    return 1.0 if "yes" in completion.split() else 0.0


def words(prompt, completion, **_):
    """A reward that varies within a group on the tiny model (so a step has samples and moves the adapter)."""
    return float(len(completion.split()))
