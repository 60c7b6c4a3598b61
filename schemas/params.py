"""Per-request generation parameters (the job's `params` object).

Field names follow the OpenAI / vLLM conventions. Validation runs in
`__post_init__`, so it applies both to JSON decoded off the wire
(`msgspec.json.decode(..., type=SamplingParams)` raises `msgspec.ValidationError`)
and to objects built in Python (raises `ValueError`); each message names the field.
"""

from __future__ import annotations

from typing import Any

import msgspec


# ---- structured outputs (params.structured): one constraint, tagged by `type` ------------------
class JsonSchemaOutput(msgspec.Struct, kw_only=True, tag="json_schema", tag_field="type"):
    """The output is one JSON value valid against `schema` (a JSON Schema object, draft
    2020-12 keywords as llguidance implements them). Compact: no whitespace between
    tokens unless the schema's `x-guidance` options allow it. `strict` (default): an
    object schema that does not say `additionalProperties` gets `false`, so the output
    holds only the properties the schema names (OpenAI's strict mode, xgrammar's default);
    False: JSON Schema's own default (any other property allowed)."""

    schema: dict[str, Any]
    strict: bool = True


class JsonObjectOutput(msgspec.Struct, kw_only=True, tag="json_object", tag_field="type"):
    """The output is one JSON object (any keys and values), compact."""


class RegexOutput(msgspec.Struct, kw_only=True, tag="regex", tag_field="type"):
    """The whole output matches `pattern` (Rust `regex` syntax, anchored at both ends)."""

    pattern: str

    def __post_init__(self) -> None:
        if not self.pattern:
            raise ValueError("params.structured.pattern must not be empty")


class ChoiceOutput(msgspec.Struct, kw_only=True, tag="choice", tag_field="type"):
    """The output is exactly one of `choices`."""

    choices: list[str]

    def __post_init__(self) -> None:
        if not self.choices or any(not c for c in self.choices):
            raise ValueError("params.structured.choices must be a non-empty list of non-empty strings")


class GrammarOutput(msgspec.Struct, kw_only=True, tag="grammar", tag_field="type"):
    """The output is a sentence of `grammar`, in llguidance's Lark dialect (a `start`
    rule; `%json {...}` embeds a JSON Schema; GBNF is converted with
    `llguidance.gbnf_to_lark`)."""

    grammar: str

    def __post_init__(self) -> None:
        if not self.grammar.strip():
            raise ValueError("params.structured.grammar must not be empty")


StructuredOutput = JsonSchemaOutput | JsonObjectOutput | RegexOutput | ChoiceOutput | GrammarOutput
STRUCTURED_TYPES = ("json_schema", "json_object", "regex", "choice", "grammar")


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """How to sample one request.

    Attributes:
        max_tokens: most tokens to generate (>= 1). None: up to the worker's
            `max_output_tokens`, capped by the model context.
        temperature: 0 means greedy (argmax); > 0 scales logits before sampling.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: drop tokens whose probability is below `min_p * p_max`; 0 disables it.
        repetition_penalty: > 0; 1 disables it. Applied to every token of the prompt
            and output as in CTRL (Keskar et al., 2019) / transformers: positive logits
            are divided by it, negative ones multiplied.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token the
            output already holds (OpenAI's and vLLM's semantics: output tokens only).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time the
            output already holds it.
        logit_bias: token id -> bias in [-100, 100], added to that token's logit before
            penalties and sampling (-100 bans it, 100 all but forces it; OpenAI's
            `logit_bias`). Ids at or beyond the model's vocabulary are rejected.
        stop: strings that end generation; the stop string is not part of the text.
        stop_token_ids: token ids that end generation, besides the model's EOS.
        seed: per-request seed; the same seed gives the same tokens whatever else
            is in the batch.
        ignore_eos: keep generating past EOS until `max_tokens`.
        logprobs: None: no logprobs. N >= 0: the sampled token's log-probability plus
            the N most likely alternatives, from the model's raw distribution (with
            `structured`: from the distribution over the tokens the constraint allows).
        structured: a constraint on the output (`{"type": "json_schema", "schema": {...}}`,
            `json_object`, `regex`, `choice`, `grammar`): each step only tokens that keep
            the output valid may be sampled, and the request ends (`stop`) when the
            output is complete. None: unconstrained.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"params.max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"params.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"params.top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"params.min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"params.repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"params.{name} must be in [-2, 2], got {getattr(self, name)}")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"params.logit_bias maps token ids >= 0 to biases in [-100, 100], got "
                                 f"{token_id}: {bias}")
        if any(not s for s in self.stop):
            raise ValueError("params.stop must not contain empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"params.stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"params.logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the tokens so far (a penalty is set)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
