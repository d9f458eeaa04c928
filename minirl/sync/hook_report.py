"""`HookReport`: what a running vLLM engine offers minirl's private hooks (`vllm_compat.check_hooks`, run in the
engine's worker at engine start: `AdapterReceiver.minirl_hooks`), and so what may run on it. Plain values: it
travels back from the worker as a dict (`dataclasses.asdict`, `from_dict`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HookReport:
    """The vLLM release and the model runner in use, the hooks absent or with other parameters, and so what may run:
    the in-memory adapter sync (`sync`) and exact per-token versions across in-place swaps (`inflight`)."""
    version: str | None
    runner: str                    # 'V1 (CPUModelRunner)', 'V2 (GPUModelRunner)', or '?'
    releases: tuple[str, ...]      # the releases the hooks were checked on (`vllm_compat.VLLM_CHECKED`)
    checked: bool                  # `version` is one of them
    missing: tuple[str, ...] = ()  # 'role.name' of each hook absent
    changed: tuple[str, ...] = ()  # 'role.name(expected parameters) is now (...)'
    sync: bool = False
    inflight: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "HookReport":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def why(self) -> str:
        """The release, the runner, and the hooks: 'checked', or what is missing or changed."""
        where = f"vLLM {self.version}, model runner {self.runner}"
        if not self.checked:
            return f"{where}: not a release minirl's hooks were checked on ({', '.join(self.releases)})"
        faults = [f"missing {', '.join(self.missing)}"] * bool(self.missing) + \
            [f"changed {', '.join(self.changed)}"] * bool(self.changed)
        return f"{where}: hooks {'; '.join(faults) or 'checked'}"

    def refusal(self) -> str:
        """The one line refusing `inflight: inflight` on this engine, with the fix."""
        return (f"inflight='inflight' needs exact per-token versions from the engine ({self.why()}): use "
                f"inflight: continue or abort, or vLLM {' / '.join(self.releases)} (pip install '.[gpu]')")
