"""How a tokenizer's chat template renders an episode, worked out once, so that no turn is ever rendered twice.

An episode's token ids are built by appending, never by re-rendering the conversation (re-rendering and
re-tokenizing earlier turns is how the ids a trainer learns from drift away from the ids the engine sampled):

    opening   the env's first messages, rendered with the generation prompt and tokenized once (the prompt)
    reply     the ids the generator sampled, exactly
    env part  what the template puts after an assistant turn, then the env's messages and the next generation
              prompt: rendered as the template's *delta* and tokenized on its own

The delta of new messages is the text the template adds when they follow a fixed dummy conversation that ends
with an assistant reply: render(dummy + messages, generation prompt) minus render(dummy). `ChatFormat` refuses a
template for which that is not a prefix (one that re-renders earlier turns). What ends an assistant turn
(`turn_end`, e.g. ChatML's `<|im_end|>` + newline) is found the same way; a reply that already ended with its
first special token (the EOS the engine stopped on) gets only the rest, a reply cut by max_tokens or a stop
string gets all of it.
"""
from __future__ import annotations

from typing import Sequence

_Q, _A = "minirl-dummy-question", "minirl-dummy-reply"
_DUMMY = ({"role": "user", "content": _Q}, {"role": "assistant", "content": _A})


class TemplateError(ValueError):
    """A chat template minirl cannot append to without re-rendering earlier turns."""


class ChatFormat:
    """The rendering of episodes for one tokenizer. `tool_format`: the template renders a `tools=` list (the
    schemas go to the model that way); else tools are described in a system message (`minirl.generation.envs`)."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tok = tokenizer
        self.template_kwargs = dict(template_kwargs or {})  # Config.chat_template_kwargs, on every rendering
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.tool_format = False
        if not self.templated:  # the plain fallback of `data.to_prompts`: one message per line
            self.turn_end = "\n"
            return
        opened = self._render(_DUMMY[:1], True)
        replied = self._render(_DUMMY, False)
        at = replied.find(_A)
        if not replied.startswith(opened) or at < 0 or replied[len(opened):at].strip():
            raise TemplateError("the chat template renders an assistant reply differently from what follows its "
                                "generation prompt, so sampled replies cannot be appended as they are; use a model "
                                "whose template renders a reply as generation prompt + reply + end of turn")
        self.turn_end = replied[at + len(_A):]
        later = self._render(list(_DUMMY) + [{"role": "user", "content": _Q}], True)
        if not later.startswith(replied):
            raise TemplateError("the chat template re-renders earlier turns when a message is added (the first "
                                "turns are not a prefix of the longer conversation); multi-turn episodes append "
                                "each turn once as token ids and need a template that does not")
        probe = [{"type": "function", "function": {"name": "probe", "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            self.tool_format = self._render(_DUMMY[:1], True, probe) != opened
        except Exception:  # noqa: BLE001 - a template that chokes on tools has no tool format
            self.tool_format = False

    def _render(self, messages: Sequence[dict], generation_prompt: bool, tools: list | None = None) -> str:
        kw = {"tools": tools} if tools else {}
        kw.update(self.template_kwargs)
        return self.tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                            **kw)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def opening(self, messages: Sequence[dict], tools: list | None = None) -> str:
        """The text of an episode's first messages with the generation prompt (what `data.to_prompts` renders)."""
        if not self.templated:
            return "\n".join(str(m["content"]) for m in messages) + "\n"
        return self._render(messages, True, tools)

    def delta(self, messages: Sequence[dict]) -> str:
        """The text the template adds for `messages` after an assistant turn, ending with the generation prompt."""
        if not self.templated:
            return "".join(str(m["content"]) + "\n" for m in messages)
        base = self._render(_DUMMY, False)
        full = self._render(list(_DUMMY) + list(messages), True)
        if not full.startswith(base):
            raise TemplateError("the chat template re-rendered earlier turns for these messages "
                                f"({[m.get('role') for m in messages]}); use a template that does not")
        return full[len(base):]

    def reply_end(self, token_ids: Sequence[int], finish_reason: str) -> str:
        """What the template expects after a sampled reply before the next message: the end of turn, minus the
        special token the reply already ended with (e.g. SmolLM2's EOS `<|im_end|>`, which is its end of turn)."""
        if finish_reason == "stop" and token_ids and token_ids[-1] in set(self.tok.all_special_ids):
            last = self.tok.decode([token_ids[-1]])
            if last and self.turn_end.startswith(last):
                return self.turn_end[len(last):]
        return self.turn_end

    def env_ids(self, reply_ids: Sequence[int], finish_reason: str, messages: Sequence[dict]) -> list[int]:
        """The token ids that follow a reply: the rest of its end of turn, `messages`, the next generation prompt.
        Tokenized once, on their own; they are appended as they are and never re-tokenized with the reply."""
        return self.encode(self.reply_end(reply_ids, finish_reason) + self.delta(messages))
