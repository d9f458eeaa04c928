"""`minirl.sandbox`: running model-written Python for code rewards (the public name; the code lives with the
rewards, in `minirl/rewards/sandbox/`, whose `__init__` says what is isolated and what is not)."""
from minirl.rewards.sandbox import (
                                    UNSANDBOXED,
                                    Sandboxed,
                                    SandboxResult,
                                    SandboxUnavailable,
                                    SplitAssert,
                                    TestsResult,
                                    as_programs,
                                    default_max_processes,
                                    extract_code,
                                    isolation,
                                    run_python,
                                    run_tests,
                                    split_assert,
                                    start,
)

__all__ = ["UNSANDBOXED", "SandboxResult", "SandboxUnavailable", "Sandboxed", "SplitAssert", "TestsResult",
           "as_programs", "default_max_processes", "extract_code", "isolation", "run_python", "run_tests",
           "split_assert", "start"]
