"""Packed causal-LM pretraining (``pack_documents``): document ids from the [SEP]s of the token
stream, the causal-LM loss of a packed batch equal to its documents run one by one, the refusal
for masked LM, and a tiny packed run end to end."""
from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from posattn import Decoder, ModelConfig
from posattn.errors import PositionError
from posattn.experiments.config import ConfigError
from posattn.pretrain.config import parse
from posattn.pretrain.data import Batch, Batches, window_documents
from posattn.pretrain.objective import CausalLM
from posattn.pretrain.run import RUN_CONFIG, pretrain
from posattn.text.corpus import Corpus, build_corpus
from posattn.text.sources import Document
from posattn.text.tokenizer import special_ids

from .conftest import WORDS, tiny


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """Documents of one or two short sentences: several of them in every window of 32 tokens."""
    rng = random.Random(1)
    docs = [Document("synthetic", str(d), " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
                                                   .capitalize() + "." for _ in range(rng.randint(1, 2))))
            for d in range(300)]
    return build_corpus(docs, tmp_path_factory.mktemp("short") / "c", vocab_size=64)


def test_a_document_ends_with_its_separator():
    sep = 2
    ids = torch.tensor([[5, 2, 7, 8, 2, 2, 9], [2, 4, 4, 4, 4, 4, 2]])
    assert window_documents(ids, sep).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


def test_packed_windows_carry_the_documents_of_their_tokens(short_docs):
    specials = special_ids(short_docs.tokenizer)
    args = (short_docs.splits["train"], "clm", 32, 8, 0, specials, short_docs.vocab_size)
    packed, _ = Batches(*args, pack=True).batch(3)
    plain, _ = Batches(*args).batch(3)
    assert plain.document_ids is None
    assert torch.equal(packed.input_ids, plain.input_ids) and torch.equal(packed.labels, plain.labels)
    docs = packed.document_ids
    assert docs.shape == packed.input_ids.shape and docs[:, 0].eq(0).all()
    step = docs[:, 1:] - docs[:, :-1]
    assert torch.equal(step, (packed.input_ids[:, :-1] == specials.sep).long())  # +1 right after each [SEP]
    assert int(docs.max()) >= 2, "the fixture packs several documents into a window"
    half = packed.shard(1, 2)
    assert torch.equal(half.document_ids, docs[4:]) and plain.shard(1, 2).document_ids is None


def test_masked_lm_refuses_packing(corpus):
    with pytest.raises(ConfigError, match=r"pack_documents: packs the causal-LM token stream \(objective: clm\); "
                                          r"mlm instances are sentence pairs of one document already"):
        parse(tiny(corpus, pack_documents=True))
    with pytest.raises(PositionError, match=r"packing documents needs the causal-LM objective \(clm\), got mlm"):
        Batches(corpus.splits["train"], "mlm", 32, 8, 0, special_ids(corpus.tokenizer), corpus.vocab_size, pack=True)


@pytest.mark.parametrize("mechanisms", [["rope", "cat"], ["alibi", "depthwise_conv"], ["lincat"]])
def test_the_packed_loss_is_the_documents_losses_one_by_one(mechanisms):
    """CausalLM hands the batch's document ids to the model: the summed loss (and its gradient)
    equals the documents' losses each computed alone on its own inputs and targets."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=24,
                                mechanisms=mechanisms, dropout=0.0)).double()
    ids = torch.randint(3, 40, (2, 13), generator=torch.Generator().manual_seed(1))
    ids[0, [3, 8]] = 2
    ids[1, 5] = 2
    labels = torch.randint(3, 40, (2, 13), generator=torch.Generator().manual_seed(2))
    docs = window_documents(ids, 2)
    ones = torch.ones_like(ids, dtype=torch.bool)
    loss, _ = CausalLM(model)(Batch(ids, labels, torch.zeros_like(ids), ones, docs))
    packed = torch.autograd.grad(loss, list(model.parameters()))
    alone = sum(F.cross_entropy(model(ids[r:r + 1, docs[r] == d])[0].float(), labels[r, docs[r] == d],
                                reduction="sum") for r in range(2) for d in docs[r].unique())  # float, as CausalLM
    torch.testing.assert_close(loss, alone, rtol=1e-6, atol=1e-5)
    for a, b in zip(packed, torch.autograd.grad(alone, list(model.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    unpacked, _ = CausalLM(model)(Batch(ids, labels, torch.zeros_like(ids), ones))
    assert abs(float(unpacked.detach() - loss.detach())) > 1e-6


def test_a_tiny_packed_run(short_docs, tmp_path):
    cfg = parse(tiny(short_docs, objective="clm", mechanisms=["rope", "cat"], pack_documents=True))
    packed = pretrain(cfg, tmp_path / "packed", progress=False)
    plain = pretrain(parse(tiny(short_docs, objective="clm", mechanisms=["rope", "cat"])), tmp_path / "plain",
                     progress=False)
    assert torch.isfinite(torch.tensor(packed["valid_loss"])) and packed["valid_loss"] != plain["valid_loss"]
    assert json.loads((tmp_path / "packed" / RUN_CONFIG).read_text())["pack_documents"] is True
    assert "pack_documents" not in json.loads((tmp_path / "plain" / RUN_CONFIG).read_text())  # as before the option
    assert pretrain(cfg, tmp_path / "packed", progress=False) == packed  # finished: not trained again
