"""Corpus building: split by document, tokenise once, memory-mapped ids, clear errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from posattn.errors import PositionError
from posattn.text.corpus import build_corpus, open_corpus
from posattn.text.sources import Document, files, sentences, split_of
from posattn.text.tokenizer import encode, load_tokenizer, special_ids, train_tokenizer

from .conftest import make_documents


def test_documents_never_straddle_splits(corpus):
    docs = make_documents()
    by_split = {s: [d for d in docs if split_of(d) == s] for s in ("train", "valid", "heldout")}
    assert all(by_split.values()), "every split gets documents"
    tok = corpus.tokenizer
    for split in ("train", "valid"):
        stored = corpus.splits[split]
        assert len(stored.documents) - 1 == len(by_split[split])
        # the stored ids decode to the documents' sentences in order
        first = by_split[split][0]
        want = [ids for ids in encode(tok, sentences(first.text)) if ids]
        s0, s1 = int(stored.documents[0]), int(stored.documents[1])
        got = [list(stored.tokens[a:b]) for a, b in stored.sentences[s0:s1]]
        assert got == want
    # a validation document's sentence never appears in train (documents are whole)
    valid_doc = by_split["valid"][0]
    train_text = " ".join(d.text for d in by_split["train"])
    assert split_of(valid_doc) == "valid" and valid_doc.text not in train_text


def test_streams_end_documents_with_sep(corpus):
    sep = special_ids(corpus.tokenizer).sep
    split = corpus.splits["train"]
    ends = [int(split.sentences[int(e) - 1, 1]) for e in split.documents[1:]]
    assert all(split.tokens[e] == sep for e in ends)
    assert int((np.asarray(split.tokens) == sep).sum()) == len(split.documents) - 1


def test_reopen_is_memory_mapped_and_checked(corpus, tmp_path):
    again = open_corpus(corpus.folder)
    assert isinstance(again.splits["train"].tokens, np.memmap)
    assert again.fingerprint == corpus.fingerprint and again.vocab_size == 64
    broken = tmp_path / "broken"
    build_corpus(make_documents(60), broken, vocab_size=64)
    with open(broken / "train.tokens.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(PositionError, match="rebuild the corpus"):
        open_corpus(broken)
    with pytest.raises(PositionError, match="not a posattn corpus"):
        open_corpus(tmp_path)


def test_empty_corpus_is_refused_and_nothing_written(tmp_path):
    with pytest.raises(PositionError, match="no text"):
        build_corpus([], tmp_path / "empty")
    with pytest.raises(PositionError, match="no text"):
        build_corpus([Document("x", "1", "   ")], tmp_path / "empty")
    assert not (tmp_path / "empty").exists()


def test_given_tokenizer_is_used_as_is(corpus, tmp_path):
    out = build_corpus(make_documents(80, seed=1), tmp_path / "c2", tokenizer=corpus.folder / "tokenizer.json")
    assert out.tokenizer.get_vocab() == corpus.tokenizer.get_vocab()
    assert out.meta["tokenizer"].endswith("tokenizer.json")


def test_unigram_and_uncased(tmp_path):
    tok = train_tokenizer([d.text for d in make_documents(40)], "unigram", 80)
    assert special_ids(tok).pad == 0 and tok.get_vocab_size() <= 80
    assert encode(tok, ["THE CAT"]) == encode(tok, ["the cat"])
    with pytest.raises(PositionError, match="kind"):
        train_tokenizer(["a"], "bpe")


def test_tokenizer_without_specials_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(PositionError, match=r"missing special token\(s\) \[PAD\], \[CLS\], \[SEP\], \[MASK\]"):
        load_tokenizer(tmp_path)


def test_user_files_and_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text("First doc. Second sentence.")
    (tmp_path / "a" / "skip.bin").write_bytes(b"\x00")
    (tmp_path / "two.md").write_text("Another doc.")
    docs = files([tmp_path / "a", tmp_path / "two.md"])
    assert [d.id for d in docs] == ["one.txt", "two.md"]
    assert sentences(docs[0].text) == ["First doc.", "Second sentence."]
    with pytest.raises(PositionError, match="no such file"):
        files([tmp_path / "missing"])
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(PositionError, match="not UTF-8"):
        files([tmp_path / "bad.txt"])


def test_saved_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = make_documents(50)
    datasets.Dataset.from_dict({"body": [d.text for d in docs]}).save_to_disk(str(tmp_path / "ds"))
    from posattn.text.sources import saved_dataset
    got = saved_dataset(tmp_path / "ds", "body")
    assert [d.text for d in got] == [d.text for d in docs]
    with pytest.raises(PositionError, match="no column 'text'"):
        saved_dataset(tmp_path / "ds")


def test_corpus_command(tmp_path, capsys):
    from posattn.cli import main
    (tmp_path / "texts").mkdir()
    for d in make_documents(80):
        (tmp_path / "texts" / f"{d.id}.txt").write_text(d.text)
    assert main(["corpus", "--files", str(tmp_path / "texts"), "--vocab-size", "64", "--out", str(tmp_path / "c")]) == 0
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] > meta["splits"]["valid"]["documents"] > 0
    assert main(["corpus", "--files", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_corpus_command_defaults_to_the_builtin_sources(tmp_path, monkeypatch):
    """``posattn corpus`` with no source option builds the default sources (it crashed on None)."""
    from posattn.cli import main
    from posattn.text.sources import BUILTIN, DEFAULT_SOURCES, Document
    for i, name in enumerate(DEFAULT_SOURCES):
        docs = [Document(name, d.id, d.text) for d in make_documents(60, seed=i)]
        monkeypatch.setitem(BUILTIN, name, lambda docs=docs: docs)
    assert main(["corpus", "--vocab-size", "64", "--out", str(tmp_path / "c")]) == 0
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert meta["sources"] == sorted(DEFAULT_SOURCES)
    assert meta["description"] == " + ".join(DEFAULT_SOURCES)


def test_wordpiece_ids_do_not_depend_on_the_process(tmp_path):
    """The trainer numbers ``##`` tokens in a per-process hash order (each process here has its own);
    one vocabulary must always get the same ids. (On count ties the trainer can also pick another
    merge, so on this small corpus the vocabulary itself may differ between processes.)"""
    import subprocess
    import sys
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps([d.text for d in make_documents(60)]))
    script = ("import json, sys; from posattn.text.tokenizer import train_tokenizer; "
              "print(json.dumps(train_tokenizer(json.load(open(sys.argv[1])), vocab_size=120).get_vocab()))")
    by_vocabulary: dict[frozenset, list[dict]] = {}
    for _ in range(4):
        out = subprocess.run([sys.executable, "-c", script, str(texts)], capture_output=True, text=True, check=True)
        ids = json.loads(out.stdout)
        by_vocabulary.setdefault(frozenset(ids), []).append(ids)
    assert all(ids == runs[0] for runs in by_vocabulary.values() for ids in runs)
    assert all(runs[0][name] == i for runs in by_vocabulary.values()
               for i, name in enumerate(("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")))


def test_corpus_command_never_deletes_a_folder_it_did_not_write(tmp_path, monkeypatch, capsys):
    """``--out`` naming a folder with a user's file (or the working directory) is refused and the file
    survives; a corpus posattn built, or an empty folder, is replaced."""
    from posattn.cli import main
    (tmp_path / "texts").mkdir()
    for d in make_documents(80):
        (tmp_path / "texts" / f"{d.id}.txt").write_text(d.text)
    build = ["corpus", "--files", str(tmp_path / "texts"), "--vocab-size", "64", "--out"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert main([*build, str(mine)]) == 2
    assert "not a posattn corpus (it holds thesis.tex)" in capsys.readouterr().err
    monkeypatch.chdir(mine)
    assert main([*build, "."]) == 2
    (mine / "meta.json").write_text(json.dumps({"format": "posattn-corpus"}))   # looks like a corpus, holds more
    assert main([*build, str(mine)]) == 2
    assert (mine / "thesis.tex").read_text() == "years of work"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert main([*build, str(tmp_path / "empty")]) == 0 and (tmp_path / "empty" / "meta.json").exists()
    assert main([*build, str(tmp_path / "empty")]) == 0                # rebuilding its own corpus is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine", "texts"]   # no temporary folder left
