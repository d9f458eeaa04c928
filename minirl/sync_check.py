"""The run's sync check: after every push, the generator (or each vLLM server that is up) must serve the adapter
the trainer just pushed (`sync.verify` on a fixed probe). A failure stops the run with one line naming the
server; a check that cannot tell two adapters apart is recorded, not an error.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .config import Config
from .types import Generator, PolicyTrainer, Scorable
from .sync import SyncVerificationError, Verification, make_probe, verify


class SyncCheck:
    """Holds the run's probe and each target's last check (by url; '' for an in-process generator)."""

    def __init__(self, probe: tuple[Sequence[int], Sequence[int]], temperature: float):
        self.probe, self.temperature = probe, temperature
        self.last: dict[str, Verification] = {}

    @classmethod
    def for_run(cls, cfg: Config, trainer: PolicyTrainer, prompt_ids: Sequence[int]) -> "SyncCheck":
        """The probe: `prompt_ids` and up to 32 tokens of the base policy (room: the engine's max_model_len)."""
        tok = trainer.tokenizer
        n = min(32, cfg.max_prompt_tokens + cfg.max_tokens - len(prompt_ids))
        return cls(make_probe(trainer.model, prompt_ids, n, cfg.seed, tok.all_special_ids, len(tok)), cfg.temperature)

    def __call__(self, trainer: PolicyTrainer, generator: Generator) -> Verification | None:
        """Check every target now; the least convincing check (a failure raises). The trainer's probe logprobs
        at the last check are the previous adapter's (nothing is recomputed, training is not disturbed)."""
        want = trainer.logprobs(*self.probe, self.temperature)
        dtype = str(next(trainer.model.parameters()).dtype)
        replicas = generator.replicas
        targets = [(r.url, r) for r in replicas if r.alive] if replicas else [("", generator)]

        def check(key: str, target: Scorable) -> Verification:
            try:
                return verify(target, self.probe, want, trainer.version, self.last.get(key), self.temperature, dtype)
            except SyncVerificationError as e:
                raise SyncVerificationError(f"{key}: {e}" if key else str(e)) from e
        if len(targets) <= 1:
            self.last = {k: check(k, t) for k, t in targets}
        else:  # each server scores the probe on its own cores: all at once
            pool = ThreadPoolExecutor(len(targets), thread_name_prefix="minirl-verify")
            try:
                futures = [(k, pool.submit(check, k, t)) for k, t in targets]
                self.last = {k: f.result() for k, f in futures}
            finally:  # a failure or Ctrl-C does not wait for the other servers' checks (closing the run ends them)
                pool.shutdown(wait=False, cancel_futures=True)
        return min(self.last.values(), key=lambda v: (v.verified, -v.new_diff), default=None)
