"""What every side-by-side speed comparison of the benchmarks shares: two sides run in interleaved rounds, the
side that goes first alternating (A B, B A, A B, ...) so that a drift in the machine's speed (it is shared) hits
both alike; each side's tokens compared with the other's token by token; and the record of what was compared
(rounds, order, seeds, settings) written with the figures."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from minirl.generation.vllm import VLLMGenerator

Tokens = Sequence[Sequence[int]]  # one side's token sequences of a round, in a fixed order (prompt, then sample)


def sequences(groups) -> list[tuple[int, ...]]:
    """The token sequences of a list of Groups: prompt order, then sample order."""
    return [tuple(c.token_ids) for g in groups for c in g.completions]


def identical_fraction(a: Tokens, b: Tokens) -> float:
    """The fraction of positions whose token sequences are identical token by token (1.0: the same tokens). Lists
    of different lengths count the missing ones as different."""
    n = max(len(a), len(b))
    return sum(tuple(x) == tuple(y) for x, y in zip(a, b)) / n if n else 1.0


def interleaved(sides: Mapping[str, Callable[[], Tokens]], rounds: int,
                each_round: Callable[[int], None] | None = None,
                each_side: Callable[[str], None] | None = None) -> dict:
    """Run the two `sides` (name -> a call that generates and returns its token sequences) for `rounds` rounds,
    A then B in even rounds and B then A in odd ones. `each_round(r)` runs (untimed) before a round's first
    side, `each_side(name)` (untimed) before each side. Returns per side tokens/s over all rounds and per round,
    the identical fraction of the two sides' sequences per round and overall, and the order used."""
    a, b = list(sides)
    secs, toks, rates = {a: 0.0, b: 0.0}, {a: 0, b: 0}, {a: [], b: []}
    order, same, n_same, n_all = [], [], 0, 0
    for r in range(rounds):
        if each_round is not None:
            each_round(r)
        got = {}
        for name in ((a, b) if r % 2 == 0 else (b, a)):
            if each_side is not None:
                each_side(name)
            t = time.perf_counter()
            got[name] = [tuple(s) for s in sides[name]()]
            dt = time.perf_counter() - t
            n_tok = sum(len(s) for s in got[name])
            secs[name] += dt
            toks[name] += n_tok
            rates[name].append(round(n_tok / dt, 2))
        order.append([a, b] if r % 2 == 0 else [b, a])
        frac = identical_fraction(got[a], got[b])
        same.append(round(frac, 4))
        n_same += round(frac * max(len(got[a]), len(got[b])))
        n_all += max(len(got[a]), len(got[b]))
    rate = {k: toks[k] / secs[k] for k in (a, b)}
    return {f"{a}_tok_s": round(rate[a], 2), f"{b}_tok_s": round(rate[b], 2),
            f"{b}_vs_{a}": round(rate[b] / rate[a], 4),
            f"{a}_s_per_round": round(secs[a] / rounds, 3), f"{b}_s_per_round": round(secs[b] / rounds, 3),
            "identical_fraction": round(n_same / n_all, 4) if n_all else 1.0, "identical_fraction_rounds": same,
            "tokens": toks, "tok_s_rounds": rates, "rounds": rounds, "order": order}


def empty_prefix_cache(gen: VLLMGenerator) -> None:
    """Drop the engine's cached KV blocks: the next requests pay their prefills."""
    gen.call(gen.engine.reset_prefix_cache())
