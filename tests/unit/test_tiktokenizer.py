"""--tokenizer-type TikTokenizer: ids equal a tiktoken.Encoding built directly on the same file
with tiktoken's own loader (the reference), round trips, Megatron's special-token layout, the
built-in patterns against the tiktoken package's, bad files, the fingerprint, and
tools/preprocess_data.py's .bin read back.

The BPE file is made here: a byte-level BPE trained with `tokenizers` on local text, its
vocabulary turned into tiktoken's 'base64(token bytes) rank' lines in merge order."""
import argparse
import base64
import importlib.util
import json
import os
import random
import shutil

import pytest
import regex
import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public as openai_public
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer import (
    TikTokenizer,
    add_tokenizer_args,
    build_tokenizer,
    build_tokenizer_from_args,
)
from megatron.training.tokenizer.fingerprint import fingerprint
from megatron.training.tokenizer.tiktoken_tokenizer import PATTERNS
from tests.unit.tokenizer_references import bytes_to_unicode, make_corpus, train_sentencepiece

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
N = 1000  # Megatron's default --tiktoken-num-special-tokens
# Meta's LLaMA-3 pre-tokenizer regex as published (meta-llama/llama3, llama/tokenizer.py).
LLAMA3_PUBLISHED = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
WORDS = ("the quick brown fox don't WE'LL jump over 12345 lazy dogs café naïve 東京 "
         "Привет мир 🙂 👩‍👩‍👧 tab\there new\nline \"quoted\" back\\slash").split(" ")
ADVERSARIAL = ["", " ", "  \n  ", "a  \n  ", "\n\n\n", "\t \r\n \u3000x", "<|endoftext|>",
               "</s>", "<s>hi</s>", "<unk><SPECIAL_7>", "x<|endoftext|>y", "1234567890",
               "I'M you'RE it's", "e\u0301\u0301", "👩‍👩‍👧‍👦🏽", "\x00\x01\x7f\xff", "ﬁ" * 5,
               "a" * 300, " " * 70 + "end", "\ufffd\U0010fffd"]


def random_texts(seed, count=120):
    rng = random.Random(seed)
    alphabets = [(0x20, 0x7e), (0xa0, 0x2ff), (0x400, 0x4ff), (0x4e00, 0x4e80),
                 (0x1f300, 0x1f64f), (0x0, 0x20)]
    texts = []
    for _ in range(count):
        pieces = [rng.choice(WORDS) if rng.random() < 0.5 else
                  "".join(chr(rng.randint(*rng.choice(alphabets)))
                          for _ in range(rng.randint(1, 8)))
                  for _ in range(rng.randint(0, 12))]
        texts.append(rng.choice(["", " ", "  ", "\n", " \n "]).join(pieces))
    return texts


def train_ranks(corpus, vocab_size):
    """{token bytes: rank} of a byte-level BPE trained on ``corpus``; rank = merge order."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    by_id = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
    assert [i for _, i in by_id] == list(range(len(by_id)))
    return {bytes(to_byte[c] for c in token): i for token, i in by_id}


def write_bpe(path, ranks):
    with open(path, "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    return str(path)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiktoken")
    ranks = train_ranks(random_texts(0, 600) + (WORDS + ADVERSARIAL) * 20, vocab_size=700)
    assert len(ranks) == 700
    return {"root": root, "ranks": ranks, "path": write_bpe(root / "tokenizer.model", ranks)}


@pytest.fixture(autouse=True)
def no_tiktoken_cache(monkeypatch):
    # tiktoken's loader caches files by path in /tmp: read the file itself, every time.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


def package_pattern(name):
    """The tiktoken package's own regex for an OpenAI encoding, without downloading its ranks."""
    saved = openai_public.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = lambda *args, **kwargs: {}
    try:
        return getattr(openai_public, name)()["pat_str"]
    finally:
        openai_public.load_tiktoken_bpe = saved


def reference(path, pat_str, specials=("<unk>", "<s>", "</s>")):
    """tiktoken's loader and Encoding, Megatron's layout: specials first, ranks shifted by N."""
    ranks = tiktoken.load.load_tiktoken_bpe(path)
    names = list(specials) + [f"<SPECIAL_{i}>" for i in range(len(specials), N)]
    return tiktoken.Encoding("reference", pat_str=pat_str,
                             mergeable_ranks={t: r + N for t, r in ranks.items()},
                             special_tokens={name: i for i, name in enumerate(names)})


REFERENCE_PATTERNS = {"llama3": lambda: LLAMA3_PUBLISHED,
                      "cl100k": lambda: package_pattern("cl100k_base"),
                      "o200k": lambda: package_pattern("o200k_base"),
                      "v1": lambda: PATTERNS["v1"], "v2": lambda: PATTERNS["v2"]}


@pytest.mark.parametrize("pattern", list(REFERENCE_PATTERNS))
def test_ids_equal_tiktoken_on_the_same_file_and_round_trip(bpe, pattern):
    ours = TikTokenizer(bpe["path"], pattern)
    ref = reference(bpe["path"], REFERENCE_PATTERNS[pattern]())
    texts = ADVERSARIAL + random_texts(1)
    want = [ref.encode_ordinary(text) for text in texts]
    assert [ours.tokenize(text) for text in texts] == want
    assert ours.tokenize_batch(texts) == want
    assert all(ours.detokenize(ids) == text for ids, text in zip(want, texts))
    assert ours.tokenize("") == [] and len(ours.tokenize("the quick")) < len("the quick")


def test_megatron_layout_specials_first_and_never_forged(bpe):
    tok = TikTokenizer(bpe["path"], "llama3")
    assert (tok.vocab_size, tok.unk, tok.bos, tok.eos, tok.eod, tok.pad) == (
        N + 700, 0, 1, 2, 2, None)
    assert tok.vocab["<s>"] == 1 and tok.vocab["<SPECIAL_999>"] == 999
    assert tok.vocab["Ġthe"] == N + bpe["ranks"][b" the"]  # HF's byte-level spelling
    assert len(tok.vocab) == tok.vocab_size and tok.inv_vocab[N] == "!"
    for text in ("</s>", "<s>", "<unk>", "<SPECIAL_5>", "<|endoftext|>"):
        ids = tok.tokenize(text)
        assert min(ids) >= N and tok.detokenize(ids) == text  # plain text, no special id
    assert tok.tokenize("hi", bos=True, eos=True)[::len(tok.tokenize("hi")) + 1] == [1, 2]
    assert tok.detokenize([1, tok.eod]) == "<s></s>"
    custom = TikTokenizer(bpe["path"], "llama3", num_special_tokens=8,
                          special_tokens=["<pad>", "</s>", "<s>", "<unk>"])
    assert (custom.vocab_size, custom.bos, custom.eos, custom.unk) == (708, 2, 1, 3)
    assert custom.tokenize("the fox") == [i - N + 8 for i in tok.tokenize("the fox")]
    with pytest.raises(ValueError, match=r"detokenize id 708: TikTokenizer ids run 0\.\.707"):
        custom.detokenize([708])


def test_patterns_split_as_the_tiktoken_package(bpe):
    texts = ADVERSARIAL + random_texts(2, 300)
    for name, package in (("cl100k", "cl100k_base"), ("o200k", "o200k_base")):
        ours, theirs = regex.compile(PATTERNS[name]), regex.compile(package_pattern(package))
        assert all(ours.findall(t) == theirs.findall(t) for t in texts), name
    # LLaMA-3 kept cl100k's first regex; today's package keeps final whitespace whole.
    assert regex.findall(PATTERNS["llama3"], "a  \n  ") == ["a", "  \n", "  "]
    assert regex.findall(PATTERNS["cl100k"], "a  \n  ") == ["a", "  \n  "]
    assert regex.findall(PATTERNS["v1"], "Don't 123") == ["Don", "'t", " ", "1", "2", "3"]
    assert regex.findall(PATTERNS["v2"], "HelloWorld 42") == ["Hello", "World", " ", "4", "2"]


def test_megatron_vocabulary_json_gives_the_same_ids(bpe, tmp_path):
    entries = [{"rank": r, "token_bytes": base64.b64encode(t).decode(),
                "token_str": t.decode("utf-8", "replace")}
               for t, r in sorted(bpe["ranks"].items(), key=lambda item: item[1])]
    (tmp_path / "vocab.json").write_text(json.dumps(entries))
    texts = ADVERSARIAL + random_texts(3, 40)
    from_json = TikTokenizer(str(tmp_path / "vocab.json"), "v2")
    assert from_json.tokenize_batch(texts) == TikTokenizer(bpe["path"], "v2").tokenize_batch(texts)


def test_vocab_size_cuts_the_ranks_as_megatron(bpe):
    tok = TikTokenizer(bpe["path"], "llama3", vocab_size=N + 300)
    assert tok.vocab_size == N + 300 and max(tok.tokenize_batch(random_texts(4))[0]) < N + 300
    ref = tiktoken.Encoding("cut", pat_str=LLAMA3_PUBLISHED, special_tokens={}, mergeable_ranks={
        t: r for t, r in bpe["ranks"].items() if r < 300})
    assert tok.tokenize("the quick brown fox") == [
        i + N for i in ref.encode_ordinary("the quick brown fox")]
    with pytest.raises(ValueError, match=f"between {N + 256} .* and {N + 700}"):
        TikTokenizer(bpe["path"], "llama3", vocab_size=N + 701)


def lines_of(bpe):
    with open(bpe["path"]) as f:
        return f.read().splitlines()


BAD_FILES = {  # id -> (edit of the good file's lines, fragments of the message)
    "three-fields": (lambda ls: ls[:4] + [ls[4] + " x"] + ls[5:], ["line 5 has 3 fields"]),
    "bad-base64": (lambda ls: ls[:9] + ["@@@ 9"] + ls[10:], ["line 10: '@@@' is not a token "
                                                              "in base64"]),
    "rank-not-int": (lambda ls: ls[:2] + [ls[2].split()[0] + " 2.0"] + ls[3:],
                     ["line 3: the rank '2.0' is not a non-negative integer"]),
    "duplicate-token": (lambda ls: ls + [ls[0].split()[0] + " 700"],
                        ["line 701: token", "is already on line 1"]),
    "duplicate-rank": (lambda ls: ls[:-1] + [ls[-1].split()[0] + " 3"],
                       ["line 700: rank 3 is already used on line 4"]),
    "gap": (lambda ls: ls[:-1] + [ls[-1].split()[0] + " 900"],
            ["ranks must run 0..n-1", "(rank 699 is missing)"]),
    "missing-byte": (lambda ls: ["enpxcQ== 0"] + ls[1:],  # rank 0 is b"zzqq", not b"!"
                     ["lacks the single-byte tokens of 1 byte(s) (0x21)"]),
    "sentencepiece": (None, ["is not text: this is not a tiktoken BPE file",
                             "--tokenizer-type Llama2Tokenizer"]),
    "empty": (lambda ls: ["", "  "], ["is empty"]),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_name_the_file_the_line_and_the_fix(bpe, tmp_path, case):
    edit, fragments = BAD_FILES[case]
    path = tmp_path / "bad.model"
    if edit is None:
        train_sentencepiece(path, make_corpus(200), vocab_size=120, model_type="bpe")
    else:
        path.write_text("\n".join(edit(lines_of(bpe))) + "\n")
    with pytest.raises(ValueError) as info:
        TikTokenizer(str(path), "llama3")
    message = str(info.value)
    assert message.startswith(f"--tokenizer-model {path}") and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_fingerprint_tells_two_files_apart(bpe, tmp_path):
    ranks = dict(bpe["ranks"])
    a, b = (t for t, r in ranks.items() if r in (400, 401))  # same tokens, two ranks swapped
    ranks[a], ranks[b] = ranks[b], ranks[a]
    swapped = write_bpe(tmp_path / "swapped.model", ranks)
    shutil.copy(bpe["path"], tmp_path / "copy.model")
    base = fingerprint(TikTokenizer(bpe["path"], "llama3"))["sha256"]
    assert fingerprint(TikTokenizer(str(tmp_path / "copy.model"), "llama3"))["sha256"] == base
    assert fingerprint(TikTokenizer(swapped, "llama3"))["sha256"] != base
    cut = fingerprint(TikTokenizer(bpe["path"], "llama3", vocab_size=N + 699))["sha256"]
    assert cut != base


def test_flags_build_it_and_pad_the_vocabulary(bpe):
    args = add_tokenizer_args(argparse.ArgumentParser()).parse_args([
        "--tokenizer-type", "TikTokenizer", "--tokenizer-model", bpe["path"],
        "--tiktoken-pattern", "o200k", "--tiktoken-num-special-tokens", "16"])
    args.tensor_model_parallel_size = 2
    tok = build_tokenizer_from_args(args)
    assert (type(tok), tok.vocab_size, tok.padded_vocab_size, tok.eod) == (
        TikTokenizer, 716, 768, 2)  # 716 padded to a multiple of 128 x TP 2
    with pytest.raises(ValueError, match="needs --tiktoken-pattern .* llama3, cl100k, o200k"):
        build_tokenizer("TikTokenizer", tokenizer_model=bpe["path"])
    with pytest.raises(ValueError, match="lacks <unk>"):
        build_tokenizer("TikTokenizer", tokenizer_model=bpe["path"], tiktoken_pattern="v1",
                        tiktoken_special_tokens=["<s>", "</s>"])
    with pytest.raises(ValueError, match="raise it to at least 3"):
        build_tokenizer("TikTokenizer", tokenizer_model=bpe["path"], tiktoken_pattern="v1",
                        tiktoken_num_special_tokens=2)


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location(
        "preprocess_data_tool", os.path.join(REPO, "tools", "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocessing_writes_the_reference_ids(bpe, tmp_path, tool, workers):
    texts = [t for t in ADVERSARIAL + random_texts(5, 200) if t.strip()]
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    assert tool.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                      str(tmp_path / "out"), "--tokenizer-type", "TikTokenizer",
                      "--tokenizer-model", bpe["path"], "--tiktoken-pattern", "llama3",
                      "--append-eod", "--workers", str(workers)]) in (None, 0)
    ref = reference(bpe["path"], LLAMA3_PUBLISHED)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [d.tolist() for d in ds] == [ref.encode_ordinary(t) + [2] for t in texts]
