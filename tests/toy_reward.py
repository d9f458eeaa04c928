"""The toy reward of `toy_cfg` (tests/conftest.py), in a module of its own that imports nothing: a reward worker
process imports the module a reward was defined in, and conftest's imports (pytest, minirl, hence torch) cost each
worker of each toy run seconds of start-up."""


def yes_reward(prompt, completion, **_):
    """Toy task for tiny models: did the completion say 'yes'?"""
    return 1.0 if "yes" in completion.split() else 0.0
