"""GPT2BPETokenizer's tiktoken path gives exactly the ids of its tokenizers path (and of the
original Python GPT-2 BPE) on random and adversarial text, and hand-made vocabularies that
break a condition of tiktoken_bpe.py are refused (the fallback is used, and tiktoken built
naively from them would indeed give other ids)."""
import json
import logging
import random

import pytest
import tiktoken
from tokenizers import ByteLevelBPETokenizer

from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.training.tokenizer.tiktoken_bpe import (
    GPT2_PATTERN,
    _compute_classes_agree,
    byte_alphabet,
)
from tests.unit.tokenizer_references import PythonGPT2BPE, bytes_to_unicode, make_corpus

EOT = "<|endoftext|>"
SCRIPTS = ("naïve café Ærøskøbing Москва данные 東京 数据 中文字符 한국어 مرحبا עברית हिन्दी ไทย "
           "e\u0301 a\u0308\u0323 🚀 👍🏽 👨\u200d👩\u200d👧 🏳️\u200d🌈 ½ ² Ⅻ ٣ ７")
ADVERSARIAL = [
    "", " ", "\n", "  \n\n\t \r\n  ", "a" * 3000, "ab" * 2000, " " * 500 + "x", "\n" * 300,
    "9" * 1000, "12 345 6789 3.14159 1,000,000 2024-01-01 0x1F 1e-9",
    "don't I'll we've she's they're I'm he'd DON'T 's 't 're 've 'm 'll 'd ''s",
    f"one{EOT}two {EOT} {EOT}{EOT}\n<|endoftext", "<|" * 50 + "|>" * 50,
    "e\u0301\u0301\u0301 " * 20, "👨\u200d👩\u200d👧\u200d👦" * 30, "中文" * 400,
    "x\u00a0y\u2003z\u3000w\u2028v\u2029u\x85t\x1cs\x1fr", "\t\t\tword  \t ", "a\u200bb\ufeffc",
    "Ｆｕｌｌｗｉｄｔｈ ｌｅｔｔｅｒｓ", "\U0001D400\U0001D401 \U00020000\U0002A6D6",
    "antidisestablishmentarianism" * 50, "!@#$%^&*()_+-=[]{}|;':\",./<>?`~" * 20,
]


def random_texts(rng, count=400):
    """Random code points from every plane, random UTF-8 byte soup (decoded with
    replacement), and shuffled words of many scripts with odd whitespace."""
    texts = []
    pieces = SCRIPTS.split() + ["'s", "'t", "'re", " ", "  ", "\n", "\t", "\r\n", "\u00a0",
                                "42", "007", "the", "The", EOT]
    for _ in range(count):
        kind = rng.randrange(3)
        if kind == 0:
            points = [rng.choice((rng.randrange(0x80), rng.randrange(0x3000),
                                  rng.randrange(0x110000))) for _ in range(rng.randrange(60))]
            texts.append("".join(chr(p) for p in points if not 0xD800 <= p < 0xE000))
        elif kind == 1:
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(80)))
            texts.append(raw.decode("utf-8", errors="replace"))
        else:
            texts.append("".join(rng.choice(pieces) for _ in range(rng.randrange(40))))
    return texts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2,000-token GPT-2-style BPE trained on text in many scripts."""
    corpus = make_corpus(600) + [SCRIPTS * 3] + random_texts(random.Random(1), 300)
    trainer = ByteLevelBPETokenizer(add_prefix_space=False)
    trainer.train_from_iterator(corpus, vocab_size=2000, special_tokens=[EOT],
                                show_progress=False)
    return trainer.save_model(str(tmp_path_factory.mktemp("bpe")))


def test_byte_alphabet_is_gpt2s():
    assert byte_alphabet() == {char: byte for byte, char in bytes_to_unicode().items()}


def test_regex_engines_agree_on_every_code_point():
    # tiktoken's fancy-regex and tokenizers' Oniguruma: \p{L}, \p{N}, \s over all of Unicode.
    assert _compute_classes_agree()


def test_trained_bpe_uses_tiktoken_with_identical_ids(trained):
    vocab, merges = trained
    fast = GPT2BPETokenizer(vocab, merges)
    slow = GPT2BPETokenizer(vocab, merges, use_tiktoken=False)
    assert fast.uses_tiktoken and not slow.uses_tiktoken
    texts = ADVERSARIAL + random_texts(random.Random(0))
    want = [slow.tokenize(text) for text in texts]
    assert [fast.tokenize(text) for text in texts] == want
    assert fast.tokenize_batch(texts) == want == slow.tokenize_batch(texts)
    assert sum(map(len, want)) > 20000  # real work was compared
    python_bpe = PythonGPT2BPE(vocab, merges)  # the original algorithm, for good measure
    assert [python_bpe.encode(text) for text in texts[:len(ADVERSARIAL) + 50]] == \
        want[:len(ADVERSARIAL) + 50]


def test_threads_and_one_thread_give_the_same_ids(trained, monkeypatch):
    fast = GPT2BPETokenizer(*trained)
    texts = random_texts(random.Random(2), 200)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    one = fast.tokenize_batch(texts)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert fast._threads() == 4
    assert fast.tokenize_batch(texts) == one == [fast.tokenize(t) for t in texts]


def test_lone_surrogate_is_refused_on_both_paths(trained):
    fast, slow = GPT2BPETokenizer(*trained), GPT2BPETokenizer(*trained, use_tiktoken=False)
    for tokenizer in (fast, slow):
        with pytest.raises(TypeError):
            tokenizer.tokenize("a\ud800b")


# ---- hand-made vocabularies ----

def write_bpe(directory, merges, ids=None, extra=(), drop_byte=None):
    """vocab.json + merges.txt: EOT 0, the 256 byte characters, then each merge's result
    (ids in merge order unless ``ids`` overrides some), then ``extra`` tokens."""
    alphabet = [char for char in byte_alphabet() if char != drop_byte]
    tokens = [EOT] + alphabet + ["".join(m) for m in merges] + list(extra)
    vocab = {token: i for i, token in enumerate(tokens)}
    vocab.update(ids or {})
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    lines = ["#version: 0.2"] + [" ".join(m) for m in merges]
    (directory / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(directory / "vocab.json"), str(directory / "merges.txt"), vocab


def naive_tiktoken(vocab):
    """tiktoken from every vocabulary token with its id as rank: what the checks prevent."""
    decode = byte_alphabet()
    ranks = {bytes(decode[c] for c in token): i for token, i in vocab.items() if token != EOT}
    return tiktoken.Encoding("naive", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={})


REFUSED = {
    # "abc" is made from (a, bc), but HF always merges (a, b) first: abc never encodes to
    # itself, while tiktoken would merge ab + c into it.
    "not self-reachable": ([("a", "b"), ("b", "c"), ("a", "bc")], {}, "abc",
                           "does not encode to itself"),
    # bc gets a lower id than ab although (a, b) ranks first: tiktoken would merge bc first.
    "ids against merge order": ([("a", "b"), ("b", "c")], {"ab": 400, "bc": 300}, "abc",
                                "ids do not follow merge order"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_vocabulary_breaking_a_condition_is_refused(tmp_path, caplog, case):
    merges, ids, text, reason = REFUSED[case]
    vocab_file, merge_file, vocab = write_bpe(tmp_path, merges, ids)
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    with caplog.at_level(logging.WARNING):
        assert not tokenizer.uses_tiktoken
    assert "not using tiktoken" in caplog.text and reason in caplog.text
    reference = PythonGPT2BPE(vocab_file, merge_file).encode(text)
    assert tokenizer.tokenize(text) == tokenizer.tokenize_batch([text])[0] == reference
    assert naive_tiktoken(vocab).encode_ordinary(text) != reference  # the danger is real


def test_missing_byte_token_is_refused(tmp_path, caplog):
    vocab_file, merge_file, _ = write_bpe(tmp_path, [("a", "b")], drop_byte="z")
    with caplog.at_level(logging.WARNING):
        assert not GPT2BPETokenizer(vocab_file, merge_file).uses_tiktoken
    assert "byte token(s) not in the vocabulary (e.g. 'z')" in caplog.text


def test_unreachable_extra_token_is_never_produced(tmp_path):
    # "xyz" is in the vocabulary but made by no merge: HF never emits it, nor may tiktoken.
    merges = [("a", "b"), ("Ġ", "ab"), ("x", "y")]
    vocab_file, merge_file, vocab = write_bpe(tmp_path, merges, extra=["xyz"])
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    assert tokenizer.uses_tiktoken
    text = "xyz ab xyzxyz abab"
    ids = tokenizer.tokenize(text)
    assert ids == PythonGPT2BPE(vocab_file, merge_file).encode(text)
    assert vocab["xyz"] not in ids and vocab["Ġab"] in ids
    assert vocab["xyz"] in naive_tiktoken(vocab).encode_ordinary(text)


def test_regex_engines_disagreeing_means_fallback(trained, monkeypatch, caplog):
    monkeypatch.setattr("megatron.training.tokenizer.tiktoken_bpe.regex_classes_agree",
                        lambda: False)
    tokenizer = GPT2BPETokenizer(*trained)
    with caplog.at_level(logging.WARNING):
        assert not tokenizer.uses_tiktoken
    assert "disagree on \\p{L}, \\p{N} or \\s" in caplog.text
    text = "naïve 東京 don't  42\n"
    assert tokenizer.tokenize(text) == PythonGPT2BPE(*trained).encode(text)
