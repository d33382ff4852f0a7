"""Token in / token out for chat conversations: the token ids of a multi-turn chat without re-tokenising a turn.

A chat environment (a ``verifiers`` environment, a tool loop) hands the model a list of messages every turn. A
client that rendered the whole list with the chat template and tokenised it again each turn would re-tokenise the
model's own earlier answers: the ids can differ from the ones the engine sampled (a BPE merge across a boundary,
special tokens written as text), and then the trained tokens and their log-probs no longer match what was generated.

:class:`ChatTokens` never does that. The first prompt is rendered and tokenised once; after that the context grows
only by the engine's own output ids and by the ids of the NEW messages, rendered as the text the chat template puts
after an assistant turn (the rest of the turn's closing text the model did not write, the new messages, the
generation prompt) and tokenised alone.

>>> from raygym.builtin import build_tokenizer
>>> chat = ChatTokens(build_tokenizer())
>>> ids = chat.prompt_ids([{"role": "user", "content": "next:7="}])
>>> chat.tokenizer.decode(ids)
'next:7='
>>> chat.tokenizer.decode(chat.continuation_ids(chat.tokenizer.encode("8"), [{"role": "user", "content": " next:8="}]))
' next:8='
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from raygym.errors import RaygymError

# Stands in for an assistant answer while the template's text around one is measured.
_SENTINEL = "\u2063raygym-assistant\u2063"
_BASE: list[dict[str, Any]] = [{"role": "user", "content": "\u2063raygym-user\u2063"}]


def _plain(message: Any) -> dict[str, Any]:
    """A message as the plain dict chat templates read (pydantic messages of verifiers included)."""
    if isinstance(message, Mapping):
        return {k: v for k, v in message.items() if v is not None}
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        return {k: v for k, v in dump().items() if v is not None}
    raise RaygymError(f"a chat message must be a mapping, got {type(message).__name__}")


class ChatTokens:
    """Renders chat messages into token ids for one conversation, append-only (see the module docstring).

    ``chat_template_kwargs`` go to every ``apply_chat_template`` call; ``tools`` are the tool definitions the
    template renders (OpenAI's ``{"type": "function", "function": {...}}`` form).
    """

    def __init__(self, tokenizer: Any, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        if tools:
            self.kwargs["tools"] = [dict(t) for t in tools]
        closed = self._render([*_BASE, {"role": "assistant", "content": _SENTINEL}], generation_prompt=False)
        self._closed = closed
        # What the template writes after an assistant answer (e.g. "<|im_end|>\n"); "" for a bare template.
        self.turn_closing = closed[closed.rindex(_SENTINEL) + len(_SENTINEL):]

    def _render(self, messages: Sequence[Any], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template([_plain(m) for m in messages], tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.kwargs)
        return str(text)

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)] if text else []

    def prompt_ids(self, messages: Sequence[Any]) -> list[int]:
        """The ids of the first prompt: the messages rendered with the generation prompt, tokenised once."""
        return self._encode(self._render(messages, generation_prompt=True))

    def continuation_ids(self, generated_ids: Sequence[int], new_messages: Sequence[Any]) -> list[int]:
        """The ids that follow the model's last turn (``generated_ids``, as the engine returned them) when
        ``new_messages`` (tool results, a user turn) come next: the part of the template's turn closing the model
        did not write itself, the new messages and the generation prompt. Raises :class:`RaygymError` when the
        template renders a conversation differently once messages follow it (no append-only ids exist then)."""
        following = self._render([*_BASE, {"role": "assistant", "content": _SENTINEL}, *new_messages],
                                 generation_prompt=True)
        if not following.startswith(self._closed):
            raise RaygymError("the chat template renders an assistant turn differently once messages follow it, so "
                              "the conversation's token ids cannot be extended without re-tokenising; use a template "
                              "that renders earlier turns unchanged")
        tail = self.tokenizer.decode(list(generated_ids[-8:]), skip_special_tokens=False) if generated_ids else ""
        closing = self.turn_closing
        written = next((n for n in range(len(closing), 0, -1) if tail.endswith(closing[:n])), 0)
        return self._encode(closing[written:] + following[len(self._closed):])
