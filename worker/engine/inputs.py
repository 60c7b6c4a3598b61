"""What a caller hands the engine for one request: `RequestInput`, with its prompt as one
tagged value (`TextPrompt`, `ChatPrompt`, `TokenPrompt`). It is built once, from a Kafka
job (`worker.serve.starter.request_input`: the engine knows no wire schema) or from
keywords (`RequestInput.of`, tests, tools, the CLI), and taken whole by
`InputProcessor.process` and `Engine.add`; input processing turns it into the
tokenized `EngineCoreRequest`, and the core that into the
scheduler's `Request` (`Request.from_core_request`); its `RequestOptions` ride along
whole. One object per door, as vLLM's
prompt value into its input processor and `EngineCoreRequest` →
`Request.from_engine_core_request`. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.params import SamplingParams
from worker.engine.outputs import RequestOptions
from worker.engine.request import RejectReason, RequestRejected


@dataclass(slots=True, frozen=True)
class TextPrompt:
    """A text prompt, tokenized with the tokenizer's special tokens (one leading BOS kept)."""

    text: str


@dataclass(slots=True, frozen=True)
class ChatPrompt:
    """OpenAI-style chat messages rendered with the tokenizer's chat template (generation
    prompt added); `tools`: OpenAI function definitions passed to the template;
    `template_kwargs`: more template variables (a job's `chat_template_kwargs`)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None


@dataclass(slots=True, frozen=True)
class TokenPrompt:
    """Prompt token ids, used exactly as given (checked against the vocabulary)."""

    token_ids: Sequence[int]


Prompt = TextPrompt | ChatPrompt | TokenPrompt


@dataclass(slots=True, frozen=True)
class RequestInput:
    """One request before tokenization.

    Attributes:
        request_id: unique among unfinished requests (the worker uses the job id).
        prompt: the prompt, one of the three kinds.
        params: sampling parameters (`max_tokens` None: resolved by input processing).
        options: priority, tenant, cache salt, arrival time, deadline, adapter, tracing
            (`RequestOptions`: they pass to the scheduler's `Request` unchanged).
    """

    request_id: str
    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    options: RequestOptions = field(default_factory=RequestOptions)

    @classmethod
    def of(cls, request_id: str, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
           messages: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
           template_kwargs: dict[str, Any] | None = None, params: SamplingParams | None = None,
           **options: Any) -> RequestInput:
        """The keyword form: exactly one of `prompt` (text), `prompt_token_ids`,
        `messages` (with `tools` and `template_kwargs`); `options` are `RequestOptions`
        fields by name.

        Raises:
            RequestRejected: `invalid_prompt` when not exactly one prompt is given.
            TypeError: an unknown field.
        """
        if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
            raise RequestRejected(request_id, RejectReason.INVALID_PROMPT,
                                  "give exactly one of prompt, prompt_token_ids, messages")
        if prompt is not None:
            value: Prompt = TextPrompt(prompt)
        elif messages is not None:
            value = ChatPrompt(messages, tools, template_kwargs)
        else:
            value = TokenPrompt(prompt_token_ids)
        return cls(request_id, value, SamplingParams() if params is None else params, RequestOptions(**options))
