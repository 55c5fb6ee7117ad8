"""Tokenizers against references: an independent Python GPT-2 BPE and transformers' tokenizers.

Every tokenizer is trained here, once per module, on a generated corpus (well under a second
each); nothing is downloaded.
"""
import argparse
import json
from types import SimpleNamespace

import numpy as np
import pytest
import sentencepiece
from tokenizers import ByteLevelBPETokenizer, Tokenizer
from tokenizers.processors import TemplateProcessing

from megatron.training.tokenizer import (
    TOKENIZER_TYPES,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    add_tokenizer_args,
    build_tokenizer,
    build_tokenizer_from_args,
)

EOT = "<|endoftext|>"

from tests.unit.tokenizer_references import (
    SAMPLES,
    PythonGPT2BPE,
    bytes_to_unicode,
    make_corpus,
    train_sentencepiece,
)


@pytest.fixture(scope="module")
def corpus():
    return make_corpus()


@pytest.fixture(scope="module")
def texts(corpus):
    return SAMPLES + corpus[:60]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory, corpus):
    """vocab.json and merges.txt in one directory (what GPT2Tokenizer.from_pretrained reads)."""
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(corpus, vocab_size=400, special_tokens=[EOT], show_progress=False)
    directory = tmp_path_factory.mktemp("gpt2")
    vocab_file, merge_file = trainer.save_model(str(directory))
    return SimpleNamespace(dir=str(directory), vocab=vocab_file, merges=merge_file,
                           json=trainer.to_str())


@pytest.fixture(scope="module")
def gpt2(gpt2_files):
    return build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files.vocab,
                           merge_file=gpt2_files.merges)


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory, corpus):
    # LLaMA's own sentencepiece settings: BPE, byte fallback, no normalization, no pad piece.
    return train_sentencepiece(
        tmp_path_factory.mktemp("llama") / "tokenizer.model", corpus, vocab_size=500,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        add_dummy_prefix=True, allow_whitespace_only_pieces=True)


@pytest.fixture(scope="module")
def unigram_model(tmp_path_factory, corpus):
    return train_sentencepiece(
        tmp_path_factory.mktemp("unigram") / "spm.model", corpus, vocab_size=250,
        model_type="unigram", unk_id=0, bos_id=1, eos_id=2, pad_id=3, character_coverage=1.0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, gpt2_files):
    """The GPT-2 BPE as a transformers directory, plus a <s> it prepends and a <pad>."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_str(gpt2_files.json)
    tokenizer.add_special_tokens(["<s>", "<pad>"])
    tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                      eos_token=EOT, pad_token="<pad>")
    directory = tmp_path_factory.mktemp("hf")
    wrapped.save_pretrained(str(directory))
    return str(directory)


# ---- GPT2BPETokenizer ----

def test_gpt2_matches_python_bpe_and_transformers(gpt2, gpt2_files, texts):
    from transformers import GPT2Tokenizer

    table = bytes_to_unicode()  # the reference's byte alphabet: 256 distinct printable chars
    assert len(set(table.values())) == 256 and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"
    python_bpe = PythonGPT2BPE(gpt2_files.vocab, gpt2_files.merges)
    hf = GPT2Tokenizer.from_pretrained(gpt2_files.dir, local_files_only=True)
    for text in texts:
        ids = gpt2.tokenize(text)
        assert ids == python_bpe.encode(text), repr(text)
        assert ids == hf(text)["input_ids"], repr(text)
    assert gpt2.tokenize("Hello world") == python_bpe.encode("Hello world") != []
    assert gpt2.eod == gpt2.bos == gpt2.eos == hf.eos_token_id == hf.bos_token_id
    assert gpt2.pad is None


def test_gpt2_vocab_and_special_ids(gpt2, gpt2_files):
    with open(gpt2_files.vocab, encoding="utf-8") as f:
        vocab = json.load(f)
    assert gpt2.vocab_size == len(vocab) == 400
    assert gpt2.vocab == vocab
    assert gpt2.eod == vocab[EOT] == 0
    assert gpt2.inv_vocab[gpt2.eod] == EOT
    assert gpt2.inv_vocab[vocab["Ġthe"]] == "Ġthe"


def test_gpt2_endoftext_in_text_stays_text(gpt2, gpt2_files):
    # As Megatron's Python BPE: only an explicit eod id ends a document.
    from transformers import GPT2Tokenizer

    hf = GPT2Tokenizer.from_pretrained(gpt2_files.dir, local_files_only=True)
    text = f"one document{EOT}not a second one"
    ids = gpt2.tokenize(text)
    assert gpt2.eod not in ids
    assert ids == PythonGPT2BPE(gpt2_files.vocab, gpt2_files.merges).encode(text)
    assert ids == hf(text, split_special_tokens=True)["input_ids"]
    assert gpt2.detokenize(ids + [gpt2.eod]) == text + EOT


def test_gpt2_round_trip_and_batch(gpt2, texts):
    for text in texts:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text, repr(text)
    assert gpt2.tokenize_batch(texts) == [gpt2.tokenize(text) for text in texts]
    ids = gpt2.tokenize("tensor parallel")
    assert gpt2.detokenize(np.array(ids, dtype=np.uint16)) == "tensor parallel"  # as .bin stores



@pytest.mark.parametrize("use_tiktoken", [False, True])
def test_gpt2_batch_unit_cache_equals_plain_encoding_on_adversarial_whitespace(
        gpt2_files, use_tiktoken):
    """Without tiktoken, tokenize_batch cuts texts into whitespace units and caches their ids;
    with it, tiktoken encodes them in threads. Random strings dense in every kind of
    whitespace (Unicode White_Space, Python-only separators U+001C..1F, runs,
    leading/trailing) must still give exactly tokenize()'s ids, and the reference's."""
    import random

    gpt2 = GPT2BPETokenizer(gpt2_files.vocab, gpt2_files.merges, use_tiktoken=use_tiktoken)
    assert gpt2.uses_tiktoken == use_tiktoken

    alphabet = (list(" \t\n\r\v\f\x85\xa0\u1680\u2003\u2028\u2029\u202f\u3000")
                + list("\x1c\x1d\x1e\x1f") + list("aZé中'sdtlmrv09!.,-?") + ["\U0001F600"])
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
             for _ in range(3000)]
    texts += ["  it's", "a\x1cb", "!\x1c!", "x\u00a0 y", " \n\n  end  ", "\t\tword", ""]
    assert gpt2.tokenize_batch(texts) == [gpt2.tokenize(t) for t in texts]
    # Twice: the second pass is served from the cache.
    assert gpt2.tokenize_batch(texts) == [gpt2.tokenize(t) for t in texts]
    python_bpe = PythonGPT2BPE(gpt2_files.vocab, gpt2_files.merges)
    assert gpt2.tokenize_batch(texts) == [python_bpe.encode(t) for t in texts]

# ---- SentencePieceTokenizer and Llama2Tokenizer ----

def slow_llama_reference(model_file):
    """transformers' slow, sentencepiece-backed tokenizer with LLaMA's BOS-only template
    (transformers 5 spells the old slow LlamaTokenizer(legacy=True) this way)."""
    from transformers import SentencePieceBackend

    return SentencePieceBackend(vocab_file=model_file, unk_token="<unk>", bos_token="<s>",
                                eos_token="</s>", special_tokens_pattern="bos")


def test_llama2_matches_transformers_with_bos(llama_model, texts):
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=llama_model)
    reference = slow_llama_reference(llama_model)
    for text in texts:
        ids = llama.tokenize(text)
        assert ids == reference(text)["input_ids"], repr(text)
        plain = reference(text, add_special_tokens=False)["input_ids"]
        assert ids[0] == llama.bos and ids[1:] == plain
    assert llama.tokenize("Hello world", bos=False, eos=True) == (
        reference("Hello world", add_special_tokens=False)["input_ids"] + [2])
    assert llama.tokenize_batch(texts) == [llama.tokenize(text) for text in texts]
    assert llama.tokenize_batch(texts[:3], bos=False, eos=True) == [
        llama.tokenize(text, bos=False, eos=True) for text in texts[:3]]


def test_llama2_special_ids_and_round_trip(llama_model, texts):
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=llama_model)
    reference = slow_llama_reference(llama_model)
    assert (llama.bos, llama.eos, llama.eod, llama.pad) == (1, 2, 2, None)
    assert (llama.bos, llama.eos) == (reference.bos_token_id, reference.eos_token_id)
    assert llama.vocab_size == len(llama.vocab) == 500
    assert llama.inv_vocab[llama.bos] == "<s>" and llama.inv_vocab[llama.eos] == "</s>"
    # Identity normalization plus byte fallback: every text survives, whitespace included.
    for text in texts:
        assert llama.detokenize(llama.tokenize(text, eos=True)) == text, repr(text)
    # "<s>" typed in the text is text, not a BOS (as sentencepiece encodes it).
    assert llama.tokenize("a <s> b").count(llama.bos) == 1
    assert llama.detokenize(llama.tokenize("a <s> b")) == "a <s> b"


def test_llama2_pad_from_model(unigram_model):
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=unigram_model)
    assert (llama.bos, llama.eos, llama.eod, llama.pad) == (1, 2, 2, 3)


def test_sentencepiece_plain(unigram_model, corpus):
    sp = sentencepiece.SentencePieceProcessor(model_file=unigram_model)
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=unigram_model)
    assert tokenizer.vocab_size == sp.get_piece_size() == 250
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (1, 2, 2, 3)
    assert tokenizer.vocab["<pad>"] == 3 and tokenizer.inv_vocab[2] == "</s>"
    # The default nmt_nfkc normalizer collapses whitespace, so round trip normalized text.
    sentences = [" ".join(line.split()) for line in corpus[:50]]
    for text in sentences:
        ids = tokenizer.tokenize(text)
        assert ids == sp.encode(text) and ids[0] != tokenizer.bos  # no BOS/EOS added
        assert tokenizer.detokenize(ids) == text
        assert "".join(tokenizer.inv_vocab[i] for i in ids).replace("▁", " ").strip() == text
    assert tokenizer.tokenize_batch(sentences) == [tokenizer.tokenize(t) for t in sentences]


# ---- HuggingFaceTokenizer ----

def test_huggingface_directory(hf_dir, gpt2, texts):
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_name_or_path=hf_dir)
    bos = gpt2.vocab_size  # the two added tokens follow the 400 learned ones
    assert (hf.vocab_size, hf.bos, hf.pad, hf.eos, hf.eod) == (402, bos, bos + 1, gpt2.eod,
                                                               gpt2.eod)
    assert hf.vocab["<s>"] == bos and hf.inv_vocab[bos + 1] == "<pad>"
    for text in texts:
        ids = hf.tokenize(text)
        assert ids == [bos] + gpt2.tokenize(text), repr(text)  # its own special tokens kept
        assert hf.detokenize(ids) == "<s>" + text
    assert hf.tokenize_batch(texts) == [hf.tokenize(text) for text in texts]


def test_pretrained_from_hf_alias_and_megatron_flag(hf_dir, gpt2):
    by_alias = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=hf_dir)
    by_megatron_flag = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    for tokenizer in (by_alias, by_megatron_flag):
        assert isinstance(tokenizer, HuggingFaceTokenizer)
        assert tokenizer.tokenize("the model") == [400] + gpt2.tokenize("the model")
        assert tokenizer.padded_vocab_size == 512


# ---- NullTokenizer ----

def test_null_tokenizer():
    null = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert isinstance(null, NullTokenizer)
    assert (null.vocab_size, null.eod, null.bos, null.eos, null.pad) == (1001, 1000, None, None,
                                                                         None)
    assert null.tokenize("5 17\n999  1000\t0") == [5, 17, 999, 1000, 0]
    assert null.tokenize("") == []
    assert null.detokenize([5, 17, 1000]) == "5 17 1000"
    assert null.vocab["1000"] == 1000 and null.inv_vocab[7] == "7" and len(null.vocab) == 1001
    assert null.tokenize_batch(["1 2", "3"]) == [[1, 2], [3]]


# ---- padding, flags ----

@pytest.mark.parametrize("divisible_by,tp,want", [(128, 1, 512), (128, 2, 512), (64, 4, 512),
                                                  (1, 1, 400), (100, 3, 600)])
def test_padded_vocab_size_gpt2(gpt2_files, divisible_by, tp, want):
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files.vocab,
                                merge_file=gpt2_files.merges,
                                make_vocab_size_divisible_by=divisible_by,
                                tensor_model_parallel_size=tp)
    assert (tokenizer.vocab_size, tokenizer.padded_vocab_size) == (400, want)


@pytest.mark.parametrize("divisible_by,tp,want", [(128, 1, 1024), (128, 8, 1024), (128, 16, 2048),
                                                  (7, 1, 1001), (10, 3, 1020)])
def test_padded_vocab_size_null(divisible_by, tp, want):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=1000,
                                make_vocab_size_divisible_by=divisible_by,
                                tensor_model_parallel_size=tp)
    assert tokenizer.padded_vocab_size == want


def parse(argv):
    return add_tokenizer_args(argparse.ArgumentParser()).parse_args(argv)


def test_flag_defaults():
    args = parse([])
    assert (args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
            args.tokenizer_name_or_path, args.vocab_size) == (None,) * 6
    assert args.make_vocab_size_divisible_by == 128


def test_build_from_args(gpt2_files, llama_model, hf_dir):
    args = parse(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files.vocab,
                  "--merge-file", gpt2_files.merges])
    gpt2 = build_tokenizer_from_args(args)  # no TP size in the namespace: TP 1
    assert isinstance(gpt2, GPT2BPETokenizer) and gpt2.padded_vocab_size == 512

    args = parse(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files.vocab,
                  "--merge-file", gpt2_files.merges, "--make-vocab-size-divisible-by", "100"])
    args.tensor_model_parallel_size = 3  # what the training arguments add
    assert build_tokenizer_from_args(args).padded_vocab_size == 600

    llama = build_tokenizer_from_args(parse(["--tokenizer-type", "Llama2Tokenizer",
                                             "--tokenizer-model", llama_model]))
    assert isinstance(llama, Llama2Tokenizer) and llama.padded_vocab_size == 512
    sp = build_tokenizer_from_args(parse(["--tokenizer-type", "SentencePieceTokenizer",
                                          "--tokenizer-model", llama_model]))
    assert type(sp) is SentencePieceTokenizer and sp.tokenize("a b") == llama.tokenize("a b")[1:]
    hf = build_tokenizer_from_args(parse(["--tokenizer-type", "PretrainedFromHF",
                                          "--tokenizer-name-or-path", hf_dir]))
    assert isinstance(hf, HuggingFaceTokenizer) and hf.vocab_size == 402
    null = build_tokenizer_from_args(parse(["--tokenizer-type", "NullTokenizer",
                                            "--vocab-size", "1000"]))
    assert (null.vocab_size, null.padded_vocab_size) == (1001, 1024)


def test_flag_rejects_unknown_type(capsys):
    with pytest.raises(SystemExit):
        parse(["--tokenizer-type", "BertWordPieceLowerCase"])
    assert "invalid choice: 'BertWordPieceLowerCase'" in capsys.readouterr().err


# ---- errors: one test per path ----

def test_error_unknown_type():
    with pytest.raises(ValueError, match=r"unknown --tokenizer-type 'Bert'; choose one of: "
                                         + ", ".join(TOKENIZER_TYPES)):
        build_tokenizer("Bert")


def test_error_no_type():
    with pytest.raises(ValueError, match="--tokenizer-type is required; choose one of"):
        build_tokenizer_from_args(parse([]))


@pytest.mark.parametrize("tokenizer_type,given,message", [
    ("GPT2BPETokenizer", {"vocab_file": "v.json"}, r"needs --merge-file \(GPT-2's merges.txt\)"),
    ("GPT2BPETokenizer", {"merge_file": "m.txt"}, r"needs --vocab-file \(GPT-2's vocab.json\)"),
    ("SentencePieceTokenizer", {}, r"needs --tokenizer-model \(a sentencepiece .model file\)"),
    ("Llama2Tokenizer", {"vocab_file": "v.json"}, r"needs --tokenizer-model"),
    ("HuggingFaceTokenizer", {}, r"needs --tokenizer-name-or-path \(a local directory"),
    ("NullTokenizer", {"tokenizer_model": "x.model"}, r"needs --vocab-size \(ids 0..N-1, eod N\)"),
])
def test_error_missing_flag(tokenizer_type, given, message):
    # Checked before any file is opened, so the flag, not a path, is what the user reads.
    with pytest.raises(ValueError, match=f"--tokenizer-type {tokenizer_type} {message}"):
        build_tokenizer(tokenizer_type, **given)


def test_error_gpt2_missing_file(gpt2_files, tmp_path):
    missing = str(tmp_path / "merges.txt")
    with pytest.raises(FileNotFoundError, match=f"--merge-file {missing} does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files.vocab, merge_file=missing)


def test_error_gpt2_directory_as_file(gpt2_files, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"--vocab-file {tmp_path} is a directory"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path), merge_file=gpt2_files.merges)


def test_error_gpt2_malformed_vocab(gpt2_files, tmp_path):
    bad = tmp_path / "vocab.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="could not read GPT-2 BPE files --vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(bad), merge_file=gpt2_files.merges)


def test_error_gpt2_vocab_without_endoftext(gpt2_files, tmp_path):
    with open(gpt2_files.vocab, encoding="utf-8") as f:
        vocab = json.load(f)
    del vocab[EOT]
    no_eot = tmp_path / "vocab.json"
    no_eot.write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ValueError, match=r"has no <\|endoftext\|> token"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(no_eot), merge_file=gpt2_files.merges)


def test_error_llama2_missing_model(tmp_path):
    missing = str(tmp_path / "tokenizer.model")
    with pytest.raises(FileNotFoundError, match=f"--tokenizer-model {missing} does not exist"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=missing)


def test_error_sentencepiece_corrupt_model(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"this is no protobuf")
    with pytest.raises(ValueError, match=f"--tokenizer-model {bad} is not a sentencepiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(bad))


def test_error_llama2_model_without_bos(tmp_path, corpus):
    model = train_sentencepiece(tmp_path / "no_bos.model", corpus[:100], vocab_size=200,
                                model_type="unigram", bos_id=-1, eos_id=1, unk_id=0)
    assert build_tokenizer("SentencePieceTokenizer", tokenizer_model=model).bos is None
    with pytest.raises(ValueError, match="has no BOS or EOS piece .*Llama2Tokenizer needs both"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=model)


def test_error_huggingface_hub_name():
    with pytest.raises(FileNotFoundError,
                       match="--tokenizer-name-or-path meta-llama/Llama-2-7b-hf does not exist: "
                             "only local directories are supported"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_name_or_path="meta-llama/Llama-2-7b-hf")


def test_error_huggingface_file_not_directory(gpt2_files):
    with pytest.raises(FileNotFoundError, match="is a file: only local directories"):
        build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=gpt2_files.vocab)


def test_error_huggingface_directory_without_tokenizer(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path} holds no tokenizer files \\(it has: "
                                         f"nothing\\); expected one of: tokenizer.json, "):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_name_or_path=str(tmp_path))


def test_error_huggingface_model_directory_without_tokenizer_files(tmp_path):
    # transformers "loads" a one-token tokenizer from a config.json alone (the embedding then
    # fails on the data's ids): refused when built, naming what the directory has.
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    with pytest.raises(ValueError, match=r"holds no tokenizer files \(it has: config.json, "
                                         r"tokenizer_config.json\); expected one of: "
                                         r"tokenizer.json, vocab.json \+ merges.txt, vocab.txt"):
        build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(tmp_path))


def test_error_huggingface_unloadable_files_one_line(tmp_path):
    (tmp_path / "vocab.txt").write_text("")  # present, but not a tokenizer transformers loads
    with pytest.raises(ValueError, match="holds no loadable Hugging Face tokenizer") as info:
        build_tokenizer("HuggingFaceTokenizer", tokenizer_name_or_path=str(tmp_path))
    assert "\n" not in str(info.value)  # transformers' reason spans lines; ours is one


def test_error_null_bad_vocab_size():
    with pytest.raises(ValueError, match="positive integer .*got 0"):
        build_tokenizer("NullTokenizer", vocab_size=0)


def test_error_null_text_not_ids():
    null = NullTokenizer(10)
    with pytest.raises(ValueError, match="integer ids; got 'hello'"):
        null.tokenize("1 hello")
    with pytest.raises(ValueError, match=r"id 11 is outside 0..10"):
        null.tokenize("1 11")


def test_error_tokenize_batch_given_one_text(gpt2):
    with pytest.raises(TypeError, match="use tokenize"):
        gpt2.tokenize_batch("one text")


def test_error_bad_divisible_by():
    with pytest.raises(ValueError, match="make-vocab-size-divisible-by"):
        build_tokenizer("NullTokenizer", vocab_size=10, make_vocab_size_divisible_by=0)
