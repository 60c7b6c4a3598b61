"""What agent clients need of a chat answer: tool calls the model chose to make
(`tool_choice: "auto"`) and its reasoning, read from the free text in the format of the
model's family (`schemas/tool_parsers.py`, `schemas/reasoning.py`) and rendered as
OpenAI's `tool_calls`, `reasoning_content` and their streamed deltas.

The families come from `gateway.tool_parser` / `gateway.reasoning_parser`, or with
`auto` from the chat template of `gateway.tokenizer` (`schemas.output_formats.detect`).
Grammars (llguidance Lark, `auto_tool_calls` picks one per request):

- constrained "auto" (`gateway.constrained_tool_calls`, on by default): free text until
  the model writes the family's opening tag, then the call is held to the `tools`' JSON
  Schemas, so a call the model opens always parses and validates (`tool_call_grammar`);
  with a JSON `response_format` too: calls or that JSON (hermes);
- a JSON constraint on a model that reasons: the constraint starts where the reasoning
  ends (`reasoning_grammar`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from schemas import reasoning as reasoning_formats
from schemas import tool_parsers
from schemas.output_formats import detect, read_answer
from schemas.params import GrammarOutput, JsonObjectOutput, JsonSchemaOutput
from schemas.structured import COMPACT_JSON, StructuredOutputError, strict_schema
from schemas.structured import check as check_constraint
from worker.gateway.errors import ApiError
from worker.gateway.tools import ToolMode, ToolStream, chat_deltas, tool_calls

if TYPE_CHECKING:
    from worker.gateway.protocol import GenRequest

log = structlog.get_logger(__name__)

def chat_template(tokenizer: str | None) -> str | None:
    """The chat template of a checkpoint directory (`chat_template.jinja`, else
    `tokenizer_config.json`'s `chat_template`, the default one of a named list); None
    when there is none to read."""
    if tokenizer is None or not os.path.isdir(tokenizer):
        return None
    path = os.path.join(tokenizer, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    try:
        with open(os.path.join(tokenizer, "tokenizer_config.json"), encoding="utf-8") as f:
            value = json.load(f).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("tool_use") or named.get("default")
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True, slots=True)
class OutputFormats:
    """The served model's output conventions (None: not read)."""

    tool: str | None = None
    reasoning: str | None = None
    constrained: bool = True

    @classmethod
    def resolve(cls, tool_parser: str, reasoning_parser: str, constrained: bool,
                tokenizer: str | None) -> OutputFormats:
        """The configured families, `auto` ones detected from the template."""
        found_tool, found_reasoning = detect(chat_template(tokenizer)) if "auto" in (
            tool_parser, reasoning_parser) else (None, None)
        tool = found_tool if tool_parser == "auto" else None if tool_parser == "none" else tool_parser
        think = found_reasoning if reasoning_parser == "auto" else None if reasoning_parser == "none" \
            else reasoning_parser
        log.info("model output formats", tool_parser=tool, reasoning_parser=think, constrained_tool_calls=constrained,
                 detected=tool_parser == "auto" or reasoning_parser == "auto")
        return cls(tool, think, constrained)


# ---- constrained "auto" ---------------------------------------------------------------------------
_CALL_SYNTAX = {  # family -> (opening text, text between the opener and the JSON, closing text)
    "hermes": ("<tool_call>", "", "</tool_call>"),
    "mistral": ("[TOOL_CALLS]", "[", "]"),
    "llama3_json": ("<|python_tag|>", "", ""),
}


def _lark_string(s: str) -> str:
    return json.dumps(s)


# JSON as the families' templates write it (`{"name": "f", "arguments": {"x": 1}}`), with no
# other whitespace: a sampled model cannot spend its tokens on blank lines inside a call.
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(family: str, functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON Schema of one call object in `family`'s format: `name` one of the
    functions and its arguments (`parameters` for llama3_json) valid against that
    function's schema (closed, as strict mode does); llguidance's `x-guidance` options
    fix the spacing (CALL_JSON)."""
    key = "parameters" if family == "llama3_json" else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": name}, key: strict_schema(params)},
                "required": ["name", key], "additionalProperties": False}
               for name, params in functions.items()]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": CALL_JSON}


def _reasoning_first(family: str | None) -> tuple[list[str], str]:
    """(Lark lines, the expression before the answer) letting the model reason first:
    deepseek_r1 must close the `<think>` its template opened; qwen3 may write a whole
    `<think>…</think>`. Each is one lazy lexeme: it ends at the first `</think>`, which the
    lexer commits to before any other lexeme that could go on (free text)."""
    if family is None:
        return [], ""
    close = _lark_string(reasoning_formats.CLOSE)
    if family == "deepseek_r1":
        return [f"think[lazy]: TEXT {close}"], "think"
    return [f"think[lazy]: {_lark_string(reasoning_formats.OPEN)} TEXT {close}"], "think?"


def json_answer(c: Any) -> dict[str, Any] | None:
    """The JSON Schema a JSON constraint (`response_format`, a forced call) stands for, as
    the engine would compile it (strict objects closed, compact spacing); None for other
    kinds (regex, choice, grammar)."""
    if isinstance(c, JsonSchemaOutput):
        schema = strict_schema(c.schema) if c.strict else c.schema
    elif isinstance(c, JsonObjectOutput):
        schema = {"type": "object"}
    else:
        return None
    if not isinstance(schema, dict):
        return None
    return {**schema, "x-guidance": {**COMPACT_JSON, **(schema.get("x-guidance") or {})}}


def reasoning_grammar(answer: dict[str, Any], family: str) -> str:
    """A Lark grammar for a JSON answer (`json_answer`) that may come after the model's
    reasoning in `family`'s convention: the constraint applies once the reasoning ends."""
    rules, before = _reasoning_first(family)
    return "\n".join(["%llguidance {}", "TEXT: /(.|\\n)*/", *rules,
                      f"start: {before} /\\s*/ %json {json.dumps(answer)}"]) + "\n"


def tool_call_grammar(family: str, functions: dict[str, dict[str, Any]], parallel: bool = True,
                      answer: dict[str, Any] | None = None, reasoning: str | None = None) -> str:
    """A Lark grammar (llguidance) for a constrained "auto" answer: any text, or text up to
    the family's opening tag and then calls whose JSON follows `call_schema`. hermes:
    calls between tags, text between and after them (one call when not `parallel`);
    mistral: one JSON array of calls; llama3_json: calls only at the start (any text
    otherwise), separated by `;`. With `answer` (hermes only: a `response_format`'s
    schema, `json_answer`): after the `reasoning` family's reasoning, either calls and
    nothing else, or that JSON.

    Raises:
        ValueError: `answer` with a family other than hermes.
    """
    opener, lead, closer = _CALL_SYNTAX[family]
    schema = json.dumps(call_schema(family, functions))
    lines = ["%llguidance {}", "TEXT: /(.|\\n)*/"]
    if answer is not None and family != "hermes":
        raise ValueError(f"a response format beside auto tool calls: hermes only, not {family}")
    if family == "hermes" and answer is None:
        lines += [f"call_open[lazy]: TEXT {_lark_string(opener)}",
                  f"call: call_open /[ \\n]*/ %json {schema} /[ \\n]*/ {_lark_string(closer)}",
                  f"start: {'call* TEXT' if parallel else 'call? TEXT'}"]
    elif family == "hermes":
        # The reasoning first (one lazy lexeme), then calls or the format's JSON and
        # nothing else: free text would be a prefix of neither, so a model that answers
        # in prose is steered to one of the two instead of writing to the limit.
        rules, before = _reasoning_first(reasoning)
        lines += rules + [f"bare_call: {_lark_string(opener)} /[ \\n]*/ %json {schema} /[ \\n]*/ "
                          f"{_lark_string(closer)}"]
        calls = "bare_call (/\\s*/ bare_call)*" if parallel else "bare_call"
        lines += [f"start: {before} /\\s*/ ({calls} /\\s*/ | %json {json.dumps(answer)})"]
    elif family == "mistral":
        item = f"%json {schema}"
        items = f"{item} (\", \" {item})*" if parallel else item
        lines += [f"calls_open[lazy]: TEXT {_lark_string(opener)}",
                  f"start: TEXT | calls_open {_lark_string(lead)} {items} {_lark_string(closer)}"]
    else:  # llama3_json: the whole answer is the calls, or it is text not starting with "{" or the tag
        item = f"%json {schema}"
        items = f"{item} (\"; \" {item})*" if parallel else item
        lines += ["PLAIN: /([^{<]|<[^|]|<\\|[^p])(.|\\n)*/",
                  f"start: PLAIN | {_lark_string(opener)}? {items}"]
    return "\n".join(lines) + "\n"


# ---- reading an answer -----------------------------------------------------------------------------
class OutputParser:
    """One chat choice's answer read for reasoning and (with `tools`) tool calls.

    `feed(text, num_tokens)` / `finish()` return OpenAI chat deltas (`{"reasoning_content":
    …}`, `{"content": …}`, `{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments"}}]}` then argument pieces); `message(text)` the whole message fields.
    `reasoning_text`: the reasoning read so far; `reasoning_count(tokenizer)` its tokens.
    """

    def __init__(self, formats: OutputFormats, tools: bool, forced: ToolMode | None = None) -> None:
        self.formats = formats
        self.tool_family = formats.tool if tools else None
        self.forced = forced  # a named or `required` call: the answer after the reasoning is its JSON
        self._reasoning = reasoning_formats.ReasoningStream(formats.reasoning) if formats.reasoning else None
        self._calls = tool_parsers.ToolCallStream(self.tool_family) if self.tool_family else None
        self._forced = ToolStream(forced) if forced is not None else None
        self._delta_tokens: int | None = None  # tokens of deltas that were all reasoning (without a tokenizer)
        self.reasoning_text = ""
        self.num_calls = 0

    @property
    def active(self) -> bool:
        return self._reasoning is not None or self._calls is not None

    def feed(self, text: str, num_tokens: int = 0) -> list[dict[str, Any]]:
        events = self._reasoning.feed(text) if self._reasoning else [("content", text)]
        self._delta_tokens = self._delta_tokens or 0
        if num_tokens and events and all(kind == "reasoning" for kind, _ in events):
            self._delta_tokens += num_tokens
        return self._deltas(events, final=False)

    def finish(self) -> list[dict[str, Any]]:
        events = self._reasoning.finish() if self._reasoning else []
        return self._deltas(events, final=True)

    def reasoning_count(self, tokenizer: Any = None) -> int | None:
        """Tokens of the reasoning: the gateway's tokenizer (`tokenizers.Tokenizer`) over
        its text, the same however the answer was chunked; without one, the tokens of the
        deltas that were all reasoning (a delta mixing its end with the answer counts as
        answer, so the count can differ by a token between deliveries); None with neither
        (a whole answer read without its deltas, e.g. a batch line)."""
        if tokenizer is not None:
            return len(tokenizer.encode(self.reasoning_text, add_special_tokens=False).ids) if self.reasoning_text else 0
        return self._delta_tokens

    def _deltas(self, events: list[tuple[str, str]], final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in events:
            if kind == "reasoning":
                self.reasoning_text += text
                out.append({"reasoning_content": text})
            elif self._forced is not None:
                out += self._counted(self._forced.text(text))
            elif self._calls is None:
                out.append({"content": text})
            else:
                out += self._tool_deltas(self._calls.feed(text))
        if final and self._calls is not None:
            out += self._tool_deltas(self._calls.finish())
        if final and self._forced is not None:
            out += self._counted(self._forced.finish())
        return out

    def _counted(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.num_calls += sum("id" in c for d in deltas for c in d.get("tool_calls", []))
        return deltas

    def _tool_deltas(self, events: list[tuple]) -> list[dict[str, Any]]:
        self.num_calls += sum(e[0] == "call" for e in events)
        return chat_deltas(events)

    def message(self, text: str) -> dict[str, Any]:
        """`content`, `reasoning_content` (when the model reasoned) and `tool_calls` (when
        it made calls) of a whole answer."""
        read = read_answer(text, self.tool_family, self.formats.reasoning)
        self.reasoning_text = read.reasoning or ""  # (the whole answer's, as the deltas' would be)
        fields: dict[str, Any] = {"content": read.content}
        if read.reasoning is not None:
            fields["reasoning_content"] = read.reasoning
        if self.forced is not None:
            calls = tool_calls(self.forced, read.content or "")
            if calls is not None:  # else (cut by max_tokens) the text stays the content
                fields.update(content=None, tool_calls=calls)
        if read.calls:
            fields["tool_calls"] = [{"id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}} for c in read.calls]
        return fields


def auto_tool_calls(req: GenRequest, formats: OutputFormats) -> None:
    """Fit a chat request's constraint to the model's formats:

    - `tool_choice: "auto"`: with `constrained`, `params.structured` becomes the family's
      call grammar; with a JSON `response_format` too (hermes), a grammar of either calls
      or that JSON after the reasoning (else the format alone constrains).
    - A JSON constraint (`response_format`, a forced call) on a model that reasons: the
      constraint starts after the reasoning (`reasoning_grammar`), so the model still
      thinks first and the parser reads its reasoning apart.
    Sets `req.reasoning_first` when the answer's reasoning is to be read.

    Raises:
        ApiError: 400 when "auto" needs a tool call format that is not known (no
            `gateway.tool_parser` and no template to read it from), or the grammar does
            not compile (the tools' or the format's schemas).
    """
    mode = req.tool_mode
    auto = mode is not None and mode.auto
    if auto and formats.tool is None:
        raise ApiError(400, "'tool_choice' 'auto' needs the model's tool call format: set gateway.tool_parser (one of "
                       f"{list(tool_parsers.FAMILIES)}) or gateway.tokenizer to the checkpoint, whose chat template "
                       "shows it; or send 'required', a named function, or 'none'.", param="tool_choice",
                       code="unsupported_parameter")
    current = req.params.structured
    answer = json_answer(current) if current is not None else None
    grammar = None
    if auto and formats.constrained:
        if current is None:
            grammar = tool_call_grammar(formats.tool, mode.functions or {}, mode.parallel)
        elif answer is not None and formats.tool == "hermes":
            grammar = tool_call_grammar(formats.tool, mode.functions or {}, mode.parallel, answer=answer,
                                        reasoning=formats.reasoning)
    elif answer is not None and formats.reasoning is not None and req.messages is not None:
        grammar = reasoning_grammar(answer, formats.reasoning)  # (chat only: a completion has no template)
    req.reasoning_first = current is None or grammar is not None
    if grammar is None:
        return
    constraint = GrammarOutput(grammar=grammar)
    try:
        check_constraint(constraint)
    except StructuredOutputError as e:
        raise ApiError(400, f"Invalid tool parameters or response format: {e}", param="tools" if auto else
                       "response_format", code="invalid_structured_output") from None
    req.params = msgspec.structs.replace(req.params, structured=constraint)


def output_parser(req: GenRequest, formats: OutputFormats) -> OutputParser | None:
    """The parser of one chat choice: its reasoning when the constraint leaves room for it
    (`req.reasoning_first`, set by `auto_tool_calls`), "auto" tool calls, and a forced
    call's output after the reasoning; None when there is nothing to read (plain text,
    or a forced call the renderer reads itself)."""
    from worker.gateway.protocol import Kind

    if req.kind != Kind.CHAT:
        return None
    mode = req.tool_mode
    auto = mode is not None and mode.auto
    think = formats.reasoning if req.reasoning_first else None
    parser = OutputParser(OutputFormats(formats.tool, think, formats.constrained), tools=auto,
                          forced=mode if mode is not None and not auto and think else None)
    return parser if parser.active else None
