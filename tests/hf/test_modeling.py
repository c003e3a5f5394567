"""posattn models as transformers models: config, Auto classes, save/load, Trainer, pipelines."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
)

import posattn  # noqa: E402
from posattn import PositionError  # noqa: E402
from posattn.hf import (  # noqa: E402
    PosattnConfig,
    PosattnForCausalLM,
    PosattnForMaskedLM,
    PosattnForSequenceClassification,
    PosattnModel,
    convert,
    from_posattn,
    hf_tokenizer,
)

IDS = torch.tensor([[2, 10, 11, 12, 3, 0], [2, 20, 21, 3, 0, 0]])
MASK = (IDS != 0).long()


def test_config_round_trips_and_refuses_bad_fields(tmp_path):
    cfg = PosattnConfig(kind="decoder", vocab_size=50, d_model=16, n_layers=3, n_heads=2, mechanisms=["rope"])
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (16, 3, 2)
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(back, PosattnConfig) and back.model_config() == cfg.model_config()
    with pytest.raises(PositionError, match="kind"):
        PosattnConfig(kind="seq2seq")
    with pytest.raises(PositionError, match="d_model 15 is not divisible"):
        PosattnConfig(d_model=15, n_heads=2)


def test_posattn_folder_loads_with_auto_classes_exactly(encoder_folder, decoder_folder):
    enc, dec = posattn.load(encoder_folder).eval(), posattn.load(decoder_folder).eval()
    mlm = AutoModelForMaskedLM.from_pretrained(encoder_folder).eval()
    assert isinstance(mlm, PosattnForMaskedLM)
    with torch.no_grad():
        assert torch.equal(mlm(IDS, attention_mask=MASK).logits, enc.mlm_logits(enc(IDS, attention_mask=MASK)))
        base = AutoModel.from_pretrained(encoder_folder).eval()
        assert isinstance(base, PosattnModel)
        assert torch.equal(base(IDS, attention_mask=MASK).last_hidden_state, enc(IDS, attention_mask=MASK))
        lm = AutoModelForCausalLM.from_pretrained(decoder_folder).eval()
        assert torch.equal(lm(IDS).logits, dec(IDS))


def test_heads_refuse_the_wrong_kind(decoder_folder):
    with pytest.raises(PositionError, match="needs a posattn encoder"):
        AutoModelForMaskedLM.from_pretrained(decoder_folder)


@pytest.mark.parametrize("cls", [PosattnForMaskedLM, PosattnForSequenceClassification, PosattnForCausalLM])
def test_save_pretrained_round_trip_is_exact(cls, tmp_path):
    kind = "decoder" if cls is PosattnForCausalLM else "encoder"
    torch.manual_seed(1)
    mechs = ["rope", "t5"] if kind == "decoder" else ["cat", "tisa", "diet_abs"]
    model = cls(PosattnConfig(kind=kind, vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_len=16,
                              mechanisms=mechs, num_labels=3)).eval()
    model.save_pretrained(tmp_path)
    back = cls.from_pretrained(tmp_path).eval()
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    with torch.no_grad():
        assert torch.equal(model(IDS, attention_mask=MASK).logits, back(IDS, attention_mask=MASK).logits)


def test_sequence_classification_from_an_mlm_checkpoint(encoder_folder):
    model = AutoModelForSequenceClassification.from_pretrained(encoder_folder, num_labels=3)
    out = model(IDS, attention_mask=MASK, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and out.loss.isfinite()
    out.loss.backward()
    assert model.posattn.classifier.weight.grad.abs().sum() > 0


def test_convert_and_from_posattn(encoder_folder, tmp_path):
    config = json.loads((encoder_folder / "config.json").read_text())
    del config["model_type"]  # a folder written before posattn.save stored it
    (encoder_folder / "config.json").write_text(json.dumps(config))
    out = convert(encoder_folder, tmp_path / "hf")
    mlm = AutoModelForMaskedLM.from_pretrained(out).eval()
    core = posattn.load(encoder_folder).eval()
    with torch.no_grad():
        assert torch.equal(mlm(IDS).logits, from_posattn(core)(IDS).logits)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("the cat")["input_ids"][0] == tok.cls_token_id


def test_tokenizer_template_adds_cls_and_sep(tokenizer):
    tok = hf_tokenizer(tokenizer)
    ids = tok("the cat", "a dog")
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    bare = tokenizer.encode("the cat", add_special_tokens=False).ids
    assert ids["input_ids"][: len(bare) + 2] == [cls, *bare, sep]
    assert ids["token_type_ids"][-1] == 1 and ids["input_ids"][-1] == sep
    assert tokenizer.post_processor is None  # the caller's tokenizer is left alone
    assert hf_tokenizer(tokenizer, template=False)("the cat")["input_ids"] == bare


def test_trainer_trains_a_posattn_mlm(encoder_folder, texts, tmp_path):
    pytest.importorskip("accelerate")  # transformers' Trainer needs it
    tok = hf_tokenizer(encoder_folder)
    model = AutoModelForMaskedLM.from_pretrained(encoder_folder)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = [tok(t) for t in texts[:16]]
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm_probability=0.3, seed=0)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                                          learning_rate=1e-2, report_to=[], save_strategy="no", logging_steps=1,
                                          use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    result = trainer.train()
    assert result.global_step == 4 and torch.isfinite(torch.tensor(result.training_loss))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("tisa" in k or "mechanisms" in k for k in changed) and any("tokens" in k for k in changed)


def test_fill_mask_pipeline(encoder_folder):
    tok = hf_tokenizer(encoder_folder)
    fill = transformers.pipeline("fill-mask", model=AutoModelForMaskedLM.from_pretrained(encoder_folder),
                                 tokenizer=tok, top_k=3)
    out = fill("the cat [MASK] on the mat")
    assert len(out) == 3 and all("[MASK]" not in o["sequence"] for o in out)
    scores = [o["score"] for o in out]
    assert scores == sorted(scores, reverse=True)


def test_text_generation_pipeline(decoder_folder):
    tok = hf_tokenizer(decoder_folder, template=False)
    gen = transformers.pipeline("text-generation", model=AutoModelForCausalLM.from_pretrained(decoder_folder),
                                tokenizer=tok)
    out = gen("the cat", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("the cat")


def test_packed_rows_through_the_transformers_classes(encoder_folder, decoder_folder):
    """``document_ids`` pass through every head: a packed row equals its documents run alone."""
    a, b = torch.tensor([[2, 10, 11, 3]]), torch.tensor([[2, 20, 3]])
    packed, docs = torch.cat([a, b], 1), torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        mlm = AutoModelForMaskedLM.from_pretrained(encoder_folder).eval()
        alone = torch.cat([mlm(a).logits, mlm(b).logits], 1)
        torch.testing.assert_close(mlm(packed, document_ids=docs).logits, alone, atol=1e-5, rtol=1e-5)
        base = AutoModel.from_pretrained(encoder_folder).eval()
        alone = torch.cat([base(a).last_hidden_state, base(b).last_hidden_state], 1)
        torch.testing.assert_close(base(packed, document_ids=docs).last_hidden_state, alone, atol=1e-5, rtol=1e-5)
        cls = AutoModelForSequenceClassification.from_pretrained(encoder_folder, num_labels=3).eval()
        alone = torch.cat([cls(a).logits, cls(b).logits])
        torch.testing.assert_close(cls(packed, document_ids=docs).logits, alone, atol=1e-5, rtol=1e-5)
        lm = AutoModelForCausalLM.from_pretrained(decoder_folder).eval()
        alone = torch.cat([lm(a).logits, lm(b).logits], 1)
        torch.testing.assert_close(lm(packed, document_ids=docs).logits, alone, atol=1e-5, rtol=1e-5)
        with pytest.raises(PositionError, match="document_ids"):
            lm(packed, document_ids=torch.tensor([[1, 0, 0, 0, 1, 1, 1]]))
