"""Budget-aware closing (worker/engine/closing.py) on a real model: constrained requests
that run into `max_tokens` in the middle of their JSON (a random-init model writes
strings until it is stopped) end parseable and valid with closing on, and mostly broken
with it off (so the check can fail); rows far from their limit are never narrowed."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from schemas.params import JsonSchemaOutput, SamplingParams
from tests.engine.test_structured import PROMPTS, make_engine
from worker.engine.closing import LOOKAHEAD, ClosingTable, closing_path, first_step, narrow

SCHEMA = {"type": "object", "properties": {"note": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "n": {"type": "integer"}},
          "required": ["note", "tags", "n"], "additionalProperties": False}


def outputs(engine, max_tokens: int, seeds: range):
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, structured=JsonSchemaOutput(schema=SCHEMA))
              for s in seeds]
    return engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("max_tokens", [30, 44])
def test_outputs_cut_by_max_tokens_still_parse_with_closing_and_not_without(llama_path, max_tokens):
    on = outputs(make_engine(llama_path), max_tokens, range(16))
    off = outputs(make_engine(llama_path, structured_closing=False), max_tokens, range(16))
    assert all(valid(o.text) for o in on), [o.text for o in on if not valid(o.text)]
    assert all(len(o.token_ids) <= max_tokens for o in on)
    assert sum(not valid(o.text) for o in off) >= 8  # the same requests without it are cut mid-JSON


def test_the_table_ranks_closers_first_and_openers_last_and_far_rows_are_left_alone(llama_path):
    table = ClosingTable(['"}', '"', "}", "a", "ab", ",", '{"', None, "x", " "], frozenset({8}))
    order = list(np.argsort(table.rank, kind="stable"))
    assert order[:3] == [0, 1, 2] and order[3] == 5 and order[4:6] == [4, 3] and order[6:8] == [6, 9]
    assert table.rank[7] == table.rank[8] == 1 << 30  # special and EOS tokens are never picked

    from llguidance import LLMatcher

    engine = make_engine(llama_path)
    tok = engine.input.tokenizer
    from worker.engine.structured import ll_tokenizer

    lt = ll_tokenizer(tok, engine.core.runner.vocab_size if hasattr(engine.core.runner, "vocab_size") else len(tok),
                      frozenset({tok.eos_token_id}))
    m = LLMatcher(lt, LLMatcher.grammar_from_json_schema(SCHEMA))  # whitespace allowed anywhere: blanks ranked last
    table = ClosingTable.of_tokenizer(tok, len(tok), frozenset({tok.eos_token_id}))
    path = closing_path(m, table, 200)
    assert path is not None and valid(tok.decode(path))  # from the start state: a whole valid answer
    bitmask = np.full((1, (len(tok) + 31) // 32), -1, dtype=np.int32)
    assert not narrow(m, table, LOOKAHEAD + 1, bitmask, 0) and (bitmask == -1).all()
    token, steps = first_step(m, table, 200)
    bitmask = _fresh_mask(m, tok)  # what narrow takes: the row's mask as the grammar filled it
    assert steps <= len(path) and narrow(m, table, steps, bitmask, 0)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    assert list(np.flatnonzero(bits)) == [token]


def _matcher_and_table(llama_path, schema):
    from llguidance import LLMatcher

    from worker.engine.structured import ll_tokenizer

    tok = make_engine(llama_path).input.tokenizer
    lt = ll_tokenizer(tok, len(tok), frozenset({tok.eos_token_id}))
    m = LLMatcher(lt, LLMatcher.grammar_from_json_schema(schema))
    return tok, m, ClosingTable.of_tokenizer(tok, len(tok), frozenset({tok.eos_token_id}))


def _fresh_mask(m, tok) -> np.ndarray:
    import llguidance.numpy as lln

    bitmask = np.full((1, (len(tok) + 31) // 32), -1, dtype=np.int32)
    lln.fill_next_token_bitmask(m, bitmask, 0)
    return bitmask


def test_a_row_too_far_from_its_end_is_searched_rarely_and_a_way_that_fits_is_followed_without_searching(
        llama_path, monkeypatch):
    """The cost of closing is its searches (each walks the way, a mask fill per token):
    a row whose way is longer than it can go is searched once and then retired, and a row
    narrowed onto a way that ends in time follows it with no search per step."""
    import worker.engine.closing as closing

    searches = []
    real = closing._greedy
    monkeypatch.setattr(closing, "_greedy", lambda *a: searches.append(a[2]) or real(*a))
    many = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(30)},
            "required": [f"k{i}" for i in range(30)], "additionalProperties": False}
    tok, m, table = _matcher_and_table(llama_path, many)  # from the start: ~90 tokens to an end
    plan = closing.ClosingPlan()
    for remaining in range(LOOKAHEAD, 0, -1):  # the row writes nothing that changes its way
        assert not narrow(m, table, remaining, _fresh_mask(m, tok), 0, plan)
    assert searches == [LOOKAHEAD + closing.REACH] and plan.look_at == closing.RETIRED

    tok, m, table = _matcher_and_table(llama_path, SCHEMA)
    way = closing.best_way(m, table, 200)
    searches.clear()
    plan = closing.ClosingPlan()
    remaining = len(way)  # just enough: narrowed from the first step, the way ends in time
    taken = []
    while not m.is_accepting():
        bitmask = _fresh_mask(m, tok)
        assert narrow(m, table, remaining, bitmask, 0, plan)
        token = int(np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))[0])
        assert m.consume_token(token)
        taken.append(token)
        remaining -= 1
    assert taken == way and valid(tok.decode(taken))
    assert len(searches) == 1  # one look, at the first step; none while following the way


def test_a_retired_row_is_looked_at_again_once_its_grammar_reaches_an_end_by_itself(llama_path, monkeypatch):
    """Retiring is about the way in progress: when the grammar accepts (the output closed
    what it had open), a later part — another call, here a short bracket — is a new way,
    searched and narrowed in time."""
    from llguidance import LLMatcher

    import worker.engine.closing as closing
    from worker.engine.structured import ll_tokenizer

    searches = []
    real = closing._greedy
    monkeypatch.setattr(closing, "_greedy", lambda *a: searches.append(a[2]) or real(*a))
    tok = make_engine(llama_path).input.tokenizer
    lt = ll_tokenizer(tok, len(tok), frozenset({tok.eos_token_id}))
    literal = " ".join(str(i) for i in range(100, 140))  # ~120 tokens, every one of them required
    m = LLMatcher(lt, LLMatcher.grammar_from_lark(
        f'start: ("x" | LONG | SHORT)*\nLONG: "<{literal}>"\nSHORT: "[" /[a-z]/ "]"\n'))
    table = ClosingTable.of_tokenizer(tok, len(tok), frozenset({tok.eos_token_id}))
    plan = closing.ClosingPlan()
    assert m.consume_tokens(lt.tokenize_str("<100"))
    for remaining in range(20, 10, -1):
        assert not narrow(m, table, remaining, _fresh_mask(m, tok), 0, plan)
    assert searches == [20 + closing.REACH] and plan.look_at == closing.RETIRED
    assert m.consume_tokens(lt.tokenize_str(literal[3:] + ">")) and m.is_accepting()
    assert not narrow(m, table, 10, _fresh_mask(m, tok), 0, plan)  # accepting: EOS may come, nothing to close
    assert m.consume_tokens(lt.tokenize_str("[")) and not m.is_accepting()
    bitmask = _fresh_mask(m, tok)
    assert len(searches) == 1 and narrow(m, table, 2, bitmask, 0, plan)  # a letter and "]": exactly 2 left
    assert searches[1] == 2 + closing.REACH  # searched again (then the look-ahead's candidates)
    token = int(np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))[0])
    assert m.consume_token(token)
