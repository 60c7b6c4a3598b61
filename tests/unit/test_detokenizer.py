"""Incremental detokenizer on byte-level BPE and SentencePiece-style (Metaspace)
tokenizers built here with `tokenizers`."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from worker.model.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a test.",
    "  leading  and double  spaces  ",
    "日本語のテキストと中文字符 mixed with English",
    "emoji 🙂🚀 and 👩‍👩‍👧 family, café naïve",
    "stop words END here END again",
]
CORPUS = TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    return tok


def metaspace_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(
        [t for t in CORPUS if "日" not in t and "🙂" not in t],  # CJK / emoji must go through byte fallback
        trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<eos>", *byte_tokens], show_progress=False),
    )
    # The byte tokens were added to the vocab as "special" to reserve their ids; make them ordinary
    # vocabulary again (as in a SentencePiece model) so decoding does not skip them.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request):
    return byte_level_bpe() if request.param == "byte_level" else metaspace_bpe()


def stream(tok, ids, stop=(), chunk=1):
    d = IncrementalDetokenizer(tok, stop)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(d.add(ids[i : i + chunk]))
        if d.stopped:
            break
    deltas.append(d.flush())
    return deltas, d


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_decode(tokenizer, text):
    ids = tokenizer.encode(text).ids
    deltas, d = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == d.text
    assert all("\ufffd" not in x for x in deltas) or "\ufffd" in tokenizer.decode(ids)


def test_multibyte_character_is_never_split(tokenizer):
    ids = tokenizer.encode("🙂").ids
    assert len(ids) > 1  # several byte tokens
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == "🙂"
    assert all(x in ("", "🙂") for x in deltas)


def test_multi_token_stop_string_never_leaks(tokenizer):
    text = "stop words END here END again"
    ids = tokenizer.encode(text).ids
    deltas, d = stream(tokenizer, ids, stop=["END here"])
    assert d.stopped
    assert "".join(deltas) == "stop words "
    assert not any("END" in x for x in deltas)


def test_held_back_text_is_flushed_at_end(tokenizer):
    ids = tokenizer.encode("the quick brown fox").ids
    deltas, d = stream(tokenizer, ids, stop=["fox jumps"])  # "fox" could start the stop string
    assert not d.stopped
    assert "fox" not in "".join(deltas[:-1])  # held back while it could still match
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_spanning_chunks_of_tokens(tokenizer):
    ids = tokenizer.encode("Hello world, this is a test.").ids
    for chunk in (1, 2, 3):
        deltas, d = stream(tokenizer, ids, stop=["is a"], chunk=chunk)
        assert "".join(deltas) == "Hello world, this "
        assert d.stopped


@pytest.mark.parametrize("text", TEXTS)
def test_tokens_arriving_together_give_the_same_text(tokenizer, text):
    """Merged steps (several tokens per call, in any grouping) give exactly the text and
    the stop behaviour of one token per call."""
    import random

    ids = tokenizer.encode(text).ids
    one_by_one, d1 = stream(tokenizer, ids, stop=["END"])
    rnd = random.Random(len(text))
    for _ in range(20):
        d = IncrementalDetokenizer(tokenizer, ["END"])
        deltas, i = [], 0
        while i < len(ids) and not d.stopped:
            k = rnd.randint(1, 5)
            deltas.append(d.add(ids[i : i + k]))
            i += k
        deltas.append(d.flush())
        assert "".join(deltas) == "".join(one_by_one) == d1.text == d.text
        assert d.stopped == d1.stopped
        assert all("\ufffd" not in x for x in deltas) or "\ufffd" in tokenizer.decode(ids)
