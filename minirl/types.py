"""The data that flows through a run: small frozen dataclasses with named fields.

prompt ─► Generator ─► Group (G Completions) ─► Scorer ─► ScoredGroup ─► Trainer (Batch)

A multi-turn episode (`minirl.generation.envs`, run by `minirl.generation.episodes`) is a Completion too: everything after the prompt,
the model's replies and the environment's messages, as the token ids the generator was given and sampled, with a
per-token `mask` of the sampled ones (the loss trains only those) and an `Episode` record of what happened.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Coroutine, Protocol, Sequence, TypeVar, runtime_checkable

T = TypeVar("T")


@dataclass(frozen=True)
class SamplingParams:
    """How a generator samples. `seed` makes a request's samples reproducible (per prompt and visit)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 48
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_p: float = 0.0               # see minirl/core/logits.py: the trainer re-applies these two
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class AdapterUpdate:
    """What a sync transport delivered, for a generator to serve as policy `version` (`update_adapter`): a peft
    folder at `path` (files), or weights an engine worker installed from memory under LoRA id `slot`, with the
    worker's install `report` (for in-place swaps: the tokens each request on that id had at the swap). Neither:
    the base model (version 0), or a generator that took the bytes itself (the transformers process)."""
    version: int
    path: str | None = None
    slot: int | None = None
    report: dict | None = None


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids after the chat template, its text, and the other dataset columns. `messages`: the
    chat messages the template was given when the dataset's prompt was a list of messages (a conversational
    dataset: batched rewards then get prompts and completions as messages, as in TRL); None for a text prompt."""
    index: int
    token_ids: tuple[int, ...]
    text: str
    columns: dict[str, Any] = field(default_factory=dict)
    messages: tuple[dict, ...] | None = None


@dataclass(frozen=True)
class Episode:
    """What a multi-turn episode did besides its tokens. `messages`: the whole chat (the opening messages, then
    each reply as an assistant message and the environment's messages after it), for reward functions and
    people; the tokens are never re-rendered from it. `end`: 'done' (the env ended it), 'max_turns' or
    'max_episode_tokens' (truncated), or 'error' (the env raised: `error` says what; the episode is a recorded
    failure, left out of the loss)."""
    messages: tuple[dict, ...]
    step_rewards: tuple[float, ...]  # one per env step that gave a reward
    turns: int                       # model replies
    end: str = "done"
    tool_calls: int = 0
    tool_errors: int = 0             # calls that could not be parsed, named no tool, or raised
    error: str | None = None

    @property
    def reward(self) -> float:
        """The sum of the step rewards (the `env` reward of the run)."""
        return float(sum(self.step_rewards))

    @property
    def truncated(self) -> bool:
        return self.end in ("max_turns", "max_episode_tokens")

    def columns(self) -> dict:
        """What reward functions get besides the dataset columns: the transcript as messages and the env's part."""
        return {"messages": [dict(m) for m in self.messages], "env_reward": self.reward, "env_error": self.error,
                "turns": self.turns}


@dataclass(frozen=True)
class Completion:
    """One sampled completion, or one episode. Every token carries its behaviour logprob (the log-probability it
    was sampled with, temperature applied) and the policy version that produced it. An episode's environment
    tokens have `mask` False, logprob 0 and the version of the reply they answer: they are context, never
    trained on. `mask` None: every token was sampled (a single turn)."""
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" (EOS / stop string / env done), "length" (cut by max_tokens, max_turns or
    #                     max_episode_tokens) or "error" (the env raised)
    mask: tuple[bool, ...] | None = None
    episode: Episode | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def sampled_versions(self) -> tuple[int, ...]:
        """The versions of the sampled tokens only (what staleness is about)."""
        if self.mask is None:
            return self.versions
        return tuple(v for v, m in zip(self.versions, self.mask) if m)


@dataclass(frozen=True)
class Group:
    """G completions of one prompt: the unit of advantage computation. `temperature`: what they were sampled at
    (the trainer takes their logprobs at it, even if the run's temperature changed since)."""
    prompt: Prompt
    completions: tuple[Completion, ...]
    temperature: float = 1.0

    @property
    def oldest_version(self) -> int:
        return min((v for c in self.completions for v in c.sampled_versions), default=0)


@dataclass(frozen=True)
class RewardFailure:
    """A reward function that raised, timed out, or returned something that is not a finite number."""
    reward: str
    sample: int
    reason: str


@dataclass(frozen=True)
class ScoredGroup:
    """A group after scoring. `rewards[i]` is None when sample i is excluded (a failed or skipped reward);
    excluded samples get advantage 0 and take no part in the group's baseline or the loss. `advantages` is empty
    until the step's advantages are computed (`minirl.rewards.advantages.step_advantages`, once per step)."""
    group: Group
    rewards: tuple[float | None, ...]
    per_reward: dict[str, tuple[float | None, ...]]
    advantages: tuple[float, ...] = ()
    failures: tuple[RewardFailure, ...] = ()
    reward_versions: dict[str, str] = field(default_factory=dict)  # reward name -> source hash
    reward_weights: dict[str, float] = field(default_factory=dict)  # reward name -> weight (0: logged only)

    @property
    def included(self) -> tuple[bool, ...]:
        return tuple(r is not None for r in self.rewards)

    @property
    def zero_advantage(self) -> bool:
        """Every advantage 0 (after `step_advantages`): the group teaches nothing."""
        if len(self.advantages) != len(self.rewards):
            raise ValueError("this group's advantages are not computed yet: "
                             "minirl.rewards.advantages.step_advantages(groups, settings) first")
        return all(a == 0.0 for a in self.advantages)


# ---- the boundaries: what callers use of the trainer, of a generator, and of what samples a run's groups ---------

@runtime_checkable
class AdapterSource(Protocol):
    """What the sync transports (`minirl.sync`) use of the trainer: its policy version, its peft model (the LoRA
    parameters are the adapter: `minirl.core.adapter` packs them) and the adapter saved in peft format."""
    version: int
    model: Any  # a peft model (torch.nn.Module)

    def save_adapter(self, path: str | os.PathLike) -> Path:
        """The adapter in peft format in the folder `path` (created); returns it."""


@runtime_checkable
class PolicyTrainer(AdapterSource, Protocol):
    """What building a generator (`generation.make_generator`) and the sync check (`sync.check.SyncCheck`) use of
    the trainer, besides what the transports use: where it runs, the base model's folder, the tokenizer, and the
    policy's logprobs of a completion."""
    device: str      # 'cpu', 'cuda', 'cuda:0'
    model_path: str  # the base model's folder
    tokenizer: Any   # a transformers tokenizer

    def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float) -> list[float]:
        """Per-token logprobs of `completion_ids` after `prompt_ids` under the current adapter."""


@runtime_checkable
class Checkpointable(Protocol):
    """What checkpoints (`minirl.run.checkpoint`) and the run folder (`minirl.run.folder`) use of the trainer."""
    version: int

    def save_adapter(self, path: str | os.PathLike) -> Path: ...

    def adapter_is_finite(self) -> bool:
        """False when the adapter holds NaN or inf (it is then never saved)."""

    def state_dict(self) -> dict:
        """Optimizer, scheduler and version: with the adapter, the trainer's whole state."""

    def load_state(self, adapter_dir: str | os.PathLike, state: dict) -> None:
        """Continue from the adapter in `adapter_dir` and `state_dict()`'s output."""


@runtime_checkable
class Scorable(Protocol):
    """What the sync check (`minirl.sync.check.verify`) asks of an engine: a generator, or one of its servers."""
    dtype: str            # the engine's dtype ('float32', 'bfloat16', ...): how close its logprobs can be
    same_numerics: bool   # it runs the trainer's own model code in the trainer's dtype (noise ~0)

    def served_version(self) -> int | None:
        """The adapter version new requests get, asked from the engine itself (None: it holds no such adapter)."""

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float) -> list[float]:
        """Logprobs of `completion_ids` after `prompt_ids` under the adapter served now."""


@runtime_checkable
class Replica(Scorable, Protocol):
    """One server of a generator that has several, seen alone (checked one by one after every push)."""
    url: str
    alive: bool


@runtime_checkable
class RolloutSource(Protocol):
    """What samples a run's groups (`Pipeline`, the synchronous loop, evaluation): a generator, or the episode
    runner on one. `loop` None: it has no event loop of its own and serves one `generate` at a time; otherwise it
    is a `StreamingSource`."""
    loop: asyncio.AbstractEventLoop | None

    @property
    def version(self) -> int:
        """The adapter version new requests are served with."""

    def generate(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> list[Group]:
        """G = n completions for each prompt, one Group per prompt, in prompt order."""


@runtime_checkable
class StreamingSource(RolloutSource, Protocol):
    """A rollout source on an event loop of its own."""
    loop: asyncio.AbstractEventLoop

    def stream(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> AsyncIterator[Group]:
        """The groups of `generate` in the order they finish, iterated on `loop`."""


@runtime_checkable
class Generator(RolloutSource, Scorable, Protocol):
    """Every member a caller of a generator uses (run, pipeline, episodes, sync, sync check). Where `loop` is not
    None it is also an `AsyncGenerator`."""
    name: str
    on_event: Callable[..., None] | None  # set by the run: (kind, **fields) of engine events (servers down, ...)

    @property
    def replicas(self) -> Sequence[Replica]:
        """Its servers, each checked on its own after a push; empty: it is one engine (checked itself)."""

    def update_adapter(self, deliver: Callable[[], AdapterUpdate], in_place: bool = False) -> AdapterUpdate:
        """Run a transport's delivery (`minirl.sync`) and serve what it delivered as policy `update.version`;
        `in_place`: it may swap the weights served in place (requests finishing meanwhile wait for it)."""

    def stats(self) -> dict[str, Any]:
        """Figures for the run's summary (servers: count, restarts, regenerated groups)."""

    def describe(self) -> dict[str, Any]:
        """What the run's start event records about it (servers: each one's url, pid, log)."""

    def close(self) -> None:
        """Release the engine; idempotent."""


@runtime_checkable
class Sleeper(Protocol):
    """An engine that frees its GPU memory while the trainer works on the same GPU (vLLM sleep mode, level 1: the
    weights offloaded to CPU memory, the KV cache dropped). The run calls `sleep()` before each training step and
    `wake()` after it, then pushes and checks the adapter as after any update."""

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


@runtime_checkable
class TurnSampler(Protocol):
    """What the episode runner on an event loop (`episodes.AsyncEpisodeRunner`) uses of its generator: one
    sequence at a time on the generator's loop, coroutines run there from other threads, the version served.
    (The runner without a loop, `episodes.EpisodeRunner`, uses a `RolloutSource`: `generate`, `version`, `loop`.)"""
    loop: asyncio.AbstractEventLoop

    @property
    def version(self) -> int: ...

    async def sample(self, token_ids: Sequence[int], params: SamplingParams, seed: int | None = None) -> Completion:
        """One sequence continuing `token_ids`, sampled with exactly `seed`."""

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on `loop` and wait for its result."""


@runtime_checkable
class AsyncGenerator(Generator, StreamingSource, TurnSampler, Protocol):
    """A generator on an event loop of its own (`loop`): code on it samples one sequence (episodes' turns) or
    iterates `stream`; other threads run coroutines there with `call`."""


# ---- what a person looks at: a run, live or saved --------------------------------------------------------------

@dataclass(frozen=True)
class RunStatus:
    """A run's state as the dashboard shows it. `state`: 'not started', 'running', 'paused', 'finished', 'failed'
    (`error` says why) or 'saved' (a run folder or log read after the fact). `knobs`: the values the live controls
    start from (lr, temperature); empty for a saved run."""
    state: str
    error: BaseException | None = None
    total_steps: int | None = None
    reward_names: tuple[str, ...] = ()
    log_path: Path | None = None
    knobs: dict[str, float] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.state in ("finished", "failed", "saved")


@runtime_checkable
class RunView(Protocol):
    """What the dashboard (`minirl.ui.Dashboard`) and `render` read of a run: a live `minirl.Run`, or a saved run
    folder, its metrics.jsonl or step records (`minirl.ui.SavedRun`). A saved run has no controls: `controllable`
    is False, and its pause/resume/stop/set raise."""
    on_step: list[Callable[[dict], None]]  # called with each step's record, on the run's thread (a saved run: never)
    controllable: bool

    def status(self) -> RunStatus: ...

    def events(self) -> list[dict]:
        """The run's events so far, in order (metrics.jsonl's: 'step', 'samples', 'eval', ...)."""

    def timeline(self) -> dict | None:
        """The live pipeline's recent generation / training intervals (`Timeline.snapshot`); None when none runs."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stop(self, timeout: float | None = 60) -> None: ...

    def set(self, **knobs: Any) -> None: ...

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the run ends; its summary (a saved run: summary.json's, or {})."""
