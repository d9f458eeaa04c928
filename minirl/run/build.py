"""Building a run's parts from its config: rewards, data, trainer, generator, weight sync, prompts.

`build_parts` checks every input first (rewards and their keywords, data, tracker, model name), then loads; a bad
input fails in one line before the model loads. It writes nothing: the run folder is claimed after it (`run_dir`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from minirl.config import Config, ConfigError
from minirl.data import rows as D
from minirl.generation import Generator
from minirl.generation.env_calls import check_env_opens
from minirl.generation.episodes import make_runner
from minirl.generation.factory import make_generator
from minirl.generation.tasks import TASKS, resolve_env
from minirl.rewards import Scorer, check_columns, check_data_columns
from minirl.run.checkpoint import Checkpoint, restore
from minirl.run.placement import CpuThreads, Devices, Placement
from minirl.run.plan import RunPlan, check_run_plan
from minirl.run.trackers import check_tracker
from minirl.sync.base import WeightSync
from minirl.training.loss_fn import resolve_loss_fn
from minirl.training.models import chat_template_text, cpu_dtype_warning, cuda_dtype_note, resolve_model
from minirl.training.plan_reward import check_reward_models
from minirl.training.trainer import Trainer
from minirl.types import Episode, Prompt, RolloutSource, SamplingParams, Sleeper


@dataclass
class RunParts:
    """What a run is made of; `close()` closes what was opened, in reverse."""
    scorer: Scorer
    splits: D.Splits
    trainer: Trainer | None = None
    generator: Generator | None = None
    sync: WeightSync | None = None
    sync_why: str = ""
    rollouts: RolloutSource | None = None  # what samples the groups: the generator, or (env runs) its episode runner
    train_prompts: Sequence[Prompt] = ()
    eval_prompts: Sequence[Prompt] = ()
    plan: RunPlan | None = None  # the memory plan made before loading, each device for what it holds
    sleeper: Sleeper | None = None  # the engine that sleeps while the trainer shares its GPU (placement)

    def describe(self) -> dict[str, Any]:
        """What the run's start event records about its parts."""
        gen = self.generator
        return dict(transport=self.sync.transport, transport_why=self.sync_why, reward_versions=self.scorer.versions,
                    train_prompts=len(self.train_prompts), eval_prompts=len(self.eval_prompts), eval=self.splits.note,
                    **gen.describe())

    def close(self) -> list[tuple[str, BaseException]]:
        """Close the generator, the sync and the reward workers, each whatever the others do; (what, error) for
        each that failed to close."""
        failed = []
        for what, obj in (("generator", self.generator), ("sync", self.sync), ("reward workers", self.scorer)):
            try:
                if obj is not None:
                    obj.close()
            except BaseException as e:  # noqa: BLE001 - the caller reports it; closing goes on
                failed.append((what, e))
        self.sync = self.generator = None
        return failed


def resolve_rewards(cfg: Config, rewards: Sequence[str | Callable] | None, env: Any) -> tuple[Config, list, Any]:
    """(config, reward refs, env factory). An env (a class or factory, a built-in task's name or 'module:Class')
    makes "env" (the episode's summed step rewards) the first reward; the arithmetic default is not added to it."""
    refs = list(rewards) if rewards is not None else list(cfg.rewards)
    factory = None
    if env is not None or cfg.env is not None:
        name, factory = resolve_env(env if env is not None else cfg.env)
        if rewards is None and refs == Config().rewards:
            refs = []
        refs = ["env", *[r for r in refs if r != "env"]]
        cfg, rewards = cfg.replace(env=name), refs
    if rewards is not None:
        cfg = cfg.replace(rewards=[r if isinstance(r, str) else r.__name__ for r in rewards])
    return cfg, refs, factory


def sampling_params(c: Config, step: int) -> SamplingParams:
    """How step `step` samples (its seed: the run's and the step's, so a resumed run samples as an uninterrupted one)."""
    return SamplingParams(c.temperature, c.top_p, c.top_k, c.max_tokens, tuple(c.stop), seed=c.seed * 100_003 + step,
                          min_p=c.min_p, repetition_penalty=c.repetition_penalty)


def build_parts(cfg: Config, refs: Sequence, env: Any, data: Any, eval_data: Any, place: Placement,
                cpu: CpuThreads, checkpoint: Checkpoint | None, devices: Devices) -> RunParts:
    """Check the inputs, then load the trainer (from `checkpoint` if given), the prompts and the generator.
    On a failure, what was opened is closed."""
    c = cfg
    check_tracker(c.report_to)
    chat_template_text(c.chat_template)  # a template file that is not there: one line, before anything loads
    resolve_loss_fn(c.loss_fn)  # a loss_fn that cannot be imported: the same
    # a reward model or local judge a reward worker cannot hold: the same, before the workers start
    check_reward_models(c, [r for r in refs if not isinstance(r, str)])
    scorer = Scorer.from_config(refs, c.reward_weights, c.reward_timeout_s, c.reward_workers, c.reward_clip,
                                c.reward_memory_mb)
    data = data if data is not None else c.data
    eval_data = eval_data if eval_data is not None else c.eval_data
    if env is not None and isinstance(data, str) and data == "arithmetic" and c.env in TASKS:
        data, held = TASKS[c.env].splits(c.eval_size, c.seed)  # a built-in env task's own rows
        eval_data = held if eval_data is None else eval_data
    builtin = isinstance(data, str) and data == "arithmetic"
    data = data if builtin else D.load_rows(data, c.prompt_column, c.answer_column)  # the rows' errors come first
    cols = [k for k in (D.arithmetic_rows(1, 0) if builtin else data)[0] if k != c.prompt_column]
    if env is not None:  # an episode's reward keywords: its transcript and env reward
        cols += list(Episode((), (), 0).columns())
    cols = check_data_columns(cols)  # + completion_tokens and finish_reason
    for name, fn in scorer.rewards:
        check_columns(fn, name, cols)
    sp = D.make_splits(data, eval_data, prompt_column=c.prompt_column, eval_fraction=c.eval_fraction,
                       eval_size=c.eval_size, seed=c.seed, answer_column=c.answer_column)
    if checkpoint and checkpoint.state.get("data") != sp.fingerprint:
        raise ConfigError(f"the data differs from the data {str(checkpoint.path.parent.parent)!r} was trained on "
                          "(its checkpoint records another fingerprint); resume with the same data, or start a new run")
    if env is not None and sp.train:
        check_env_opens(env, sp.train[0])  # an env that cannot be made or opened: one line, before the model loads
    if not sp.eval:
        print(f"minirl: {sp.note}: held-out accuracy is not measured", flush=True)
    parts = RunParts(scorer, sp)
    try:
        _load(parts, c, env, place, cpu, checkpoint, devices)
    except BaseException:
        parts.close()
        raise
    return parts


def _load(parts: RunParts, c: Config, env: Any, place: Placement, cpu: CpuThreads,
          checkpoint: Checkpoint | None, devices: Devices) -> None:
    parts.scorer.start()  # reward workers up before the model loads: a reward that cannot reach them fails now
    if c.inflight != "continue" and place.backend != "vllm":
        raise ValueError(f"inflight={c.inflight!r} needs the vLLM engine (backend='vllm'); the transformers "
                         "backend finishes in-flight sequences on their adapter (inflight='continue')")
    resolve_model(c.model)  # a model that cannot be found fails here, within seconds
    parts.plan = check_run_plan(c, devices, place)  # a GPU run that cannot fit stops here, before loading
    if not place.cuda_devices and (note := cpu_dtype_warning(c.dtype)):
        print(note, flush=True)
    engine = place.backend in ("vllm", "vllm-server")
    if place.cuda_devices and (note := cuda_dtype_note(c, place.train_device, engine)):  # bf16 below 8.0 fails
        print(note, flush=True)
    cpu.apply(place)
    parts.trainer = trainer = Trainer(c, device=place.train_device, token_budget=parts.plan.token_budget)
    tok, sp = trainer.tokenizer, parts.splits
    if checkpoint is not None:
        restore(checkpoint, trainer)
        trainer.reconfigure(c)
    parts.generator, parts.sync, parts.sync_why = make_generator(c, trainer, place.backend, place.max_async_steps > 0,
                                                                 place.gen_devices, place.engine_sleeps,
                                                                 hf_slots=parts.plan.hf_slots)
    parts.sleeper = parts.generator if place.engine_sleeps else None
    if env is None:
        parts.rollouts = parts.generator
        kw = dict(template_kwargs=c.chat_template_kwargs)
        parts.train_prompts = D.to_prompts(sp.train, tok, c.prompt_column, c.system_prompt, c.max_prompt_tokens,
                                           indices=sp.train_ids, **kw)
        parts.eval_prompts = D.to_prompts(sp.eval, tok, c.prompt_column, c.system_prompt, c.max_prompt_tokens,
                                          indices=sp.eval_ids, **kw)
    else:  # episodes open with reset(row); an eval row's index follows the train rows' (the runner finds rows by it)
        parts.rollouts = runner = make_runner(parts.generator, env, tok, c.max_turns, c.max_episode_tokens,
                                              c.chat_template_kwargs)
        parts.train_prompts = runner.prompts(sp.train, c.prompt_column, c.max_prompt_tokens, indices=sp.train_ids)
        first = 1 + max(sp.train_ids, default=-1)
        parts.eval_prompts = runner.prompts(sp.eval, c.prompt_column, c.max_prompt_tokens,
                                            indices=[first + i for i in range(len(sp.eval))])
    cpu.pin(c)
    if checkpoint is not None:
        parts.sync.push(trainer, parts.generator)  # the generator serves the restored policy
