"""A structured-output constraint (`params.structured`) as an llguidance grammar, and its
check without a model: what the gateway (no tokenizer, no torch) and producers can verify
before a job is queued. The engine re-checks against the model's tokenizer
(`worker/engine/structured.py`). Needs the `llguidance` package (imported on first use).
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.params import (
    ChoiceOutput,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    RegexOutput,
    StructuredOutput,
)

# JSON without whitespace between tokens (as OpenAI's strict mode emits), so a weak model
# cannot spend its max_tokens on spaces and newlines; a schema's own `x-guidance`
# options override these.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class StructuredOutputError(ValueError):
    """A constraint that cannot be served: invalid schema / regex / grammar, too large,
    or a tokenizer llguidance cannot read. The message is the library's."""


def grammar_of(c: StructuredOutput, max_bytes: int) -> str:
    """The llguidance grammar (its JSON text) of one constraint.

    Args:
        c: the request's `params.structured`.
        max_bytes: bound on the constraint's JSON size (`max_structured_output_bytes`).

    Raises:
        StructuredOutputError: the constraint is over `max_bytes`, or not even a grammar
            (a JSON Schema that is not an object); validity is `check`'s (and, against the
            model's tokenizer, the engine's `GrammarValidator`'s).
    """
    from llguidance import LLMatcher

    size = len(msgspec.json.encode(c))
    if size > max_bytes:
        raise StructuredOutputError(f"the constraint is {size} bytes of JSON, over the limit of {max_bytes} "
                                    "(serving_tuning.max_structured_output_bytes)")
    try:
        if isinstance(c, JsonSchemaOutput):
            return LLMatcher.grammar_from_json_schema(strict_schema(c.schema) if c.strict else c.schema,
                                                      defaults=COMPACT_JSON)
        if isinstance(c, JsonObjectOutput):
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=COMPACT_JSON)
        if isinstance(c, RegexOutput):
            return LLMatcher.grammar_from_regex(c.pattern)
        if isinstance(c, ChoiceOutput):  # Lark string literals take JSON's escapes
            return LLMatcher.grammar_from_lark("start: " + " | ".join(
                msgspec.json.encode(choice).decode() for choice in c.choices))
        if isinstance(c, GrammarOutput):
            return LLMatcher.grammar_from_lark(c.grammar)
    except ValueError as e:
        raise StructuredOutputError(str(e)) from None
    raise StructuredOutputError(f"unknown constraint {type(c).__name__}")


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems")


def strict_schema(schema: Any, *, in_all_of: bool = False) -> Any:
    """A copy of `schema` where every object schema that names `properties` but says
    neither `additionalProperties` nor `unevaluatedProperties` gets
    `additionalProperties: false` (OpenAI's strict mode; xgrammar's `strict_mode`), so the
    output holds only the named properties. `{"type": "object"}` without properties stays
    any object. Branches of an `allOf` are left open (closing each would forbid the
    properties the others name); their own nested schemas are closed."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(v) for v in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict | list):
            out[key] = strict_schema(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [strict_schema(v, in_all_of=True) for v in out["allOf"]]
    if "properties" in out and not in_all_of and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def check(c: StructuredOutput, max_bytes: int = 65536) -> str:
    """The grammar of `c` if llguidance accepts it (no tokenizer: everything but the
    model's vocabulary is checked); the gateway's 400 for an invalid constraint.

    Raises:
        StructuredOutputError: with the library's message.
    """
    from llguidance import LLMatcher

    grammar = grammar_of(c, max_bytes)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(error.strip())
    return grammar
