"""posattn mechanisms retrofitted into tiny random transformers encoders of each supported family."""
from __future__ import annotations

import numpy as np
import pytest
import torch

tf = pytest.importorskip("transformers")

from posattn import PositionError  # noqa: E402
from posattn.analysis.tisa_fit import TisaFit, tisa_function  # noqa: E402
from posattn.hf.retrofit import add_mechanisms, fit_kernels  # noqa: E402

COMMON = dict(hidden_size=16, num_attention_heads=4, num_hidden_layers=2, intermediate_size=32,
              max_position_embeddings=40, vocab_size=50, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
FAMILIES = {
    "bert": (tf.BertConfig, tf.BertForMaskedLM, {}),
    "roberta": (tf.RobertaConfig, tf.RobertaForMaskedLM, {}),
    "electra": (tf.ElectraConfig, tf.ElectraForMaskedLM, {"embedding_size": 8}),
    "mpnet": (tf.MPNetConfig, tf.MPNetForMaskedLM, {}),
}
IDS = torch.randint(3, 50, (2, 11), generator=torch.Generator().manual_seed(0))
MASK = torch.ones(2, 11, dtype=torch.long)
MASK[1, 7:] = 0


def tiny(family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # non-trivial biases and norms
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).logits[MASK.bool()]


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_tisa_supplement_leaves_the_model_unchanged(family):
    model = tiny(family)
    before = logits(model)
    add_mechanisms(model, ["tisa"], mode="supplement")  # neutral start: a = 0
    assert all(float(m.a.detach().abs().max()) == 0 for m in model.modules() if getattr(m, "name", "") == "tisa")
    torch.testing.assert_close(logits(model), before, atol=2e-6, rtol=1e-5)


def manual_tisa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Independent reference: softmax(q·k/√d + f_θ(j − i)) v with TISA Eq 5 from the analysis module."""
    tisa = module.position_mechanisms[0]
    n = query.shape[-2]
    r = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    f = tisa_function(r.flatten().double(), tisa.a.double(), tisa.b.double(), tisa.c.double()).view(-1, n, n)
    s = query @ key.transpose(-1, -2) * scaling + f.to(query.dtype)
    if attention_mask is not None:
        s = s.masked_fill(~attention_mask, float("-inf"))
    return (torch.softmax(s, -1) @ value).transpose(1, 2), None


@pytest.mark.parametrize("family", ["bert", "mpnet"])
@pytest.mark.parametrize("path", ["fast", "reference"])
def test_tisa_term_matches_an_independent_reference(family, path):
    model = tiny(family)
    add_mechanisms(model, ["tisa"], mode="supplement", init="default", path=path)
    if family == "mpnet":  # one kernel set in every layer, so MPNet's shared bias can carry f_θ
        layers = [layer.attention.attn.position_mechanisms[0] for layer in model.mpnet.encoder.layer]
        with torch.no_grad():
            for other in layers[1:]:
                for name in ("a", "b", "c"):
                    getattr(other, name).copy_(getattr(layers[0], name))
    ours = logits(model)
    if family == "mpnet":  # the hook path: compare with MPNet's own bias plus f_θ added by hand
        plain = tiny(family)
        plain.mpnet.encoder.compute_position_bias = lambda x, *a, **k: bias_plus_tisa(plain, model, x)
        torch.testing.assert_close(ours, logits(plain), atol=1e-5, rtol=1e-5)
        return
    tf.AttentionInterface.register("manual_tisa", manual_tisa_attention)
    tf.masking_utils.AttentionMaskInterface.register("manual_tisa", tf.masking_utils.sdpa_mask)
    model.set_attn_implementation("manual_tisa")
    torch.testing.assert_close(ours, logits(model), atol=1e-5, rtol=1e-5)


def bias_plus_tisa(plain, retrofitted, x):
    """MPNet's own relative bias (shared by its layers) plus f_θ, tabulated by hand."""
    base = type(plain.mpnet.encoder).compute_position_bias(plain.mpnet.encoder, x)
    tisa = retrofitted.mpnet.encoder.layer[0].attention.attn.position_mechanisms[0]
    n = x.shape[1]
    r = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).flatten().double()
    return base + tisa_function(r, tisa.a.double(), tisa.b.double(), tisa.c.double()).view(-1, n, n).float()


@pytest.mark.parametrize("family", FAMILIES)
def test_replace_folds_mean_position_into_words_and_freezes_the_table(family):
    model = tiny(family)
    emb = model.base_model.embeddings
    offset = 2 if family in ("roberta", "mpnet") else 0
    mean = emb.position_embeddings.weight[offset:].mean(0).detach().clone()
    words = emb.word_embeddings.weight.detach().clone()
    add_mechanisms(model, ["tisa"], mode="replace")
    assert float(emb.position_embeddings.weight.abs().max()) == 0 and not emb.position_embeddings.weight.requires_grad
    torch.testing.assert_close(emb.word_embeddings.weight, words + mean)
    if family == "mpnet":
        assert float(model.mpnet.encoder.relative_attention_bias.weight.abs().max()) == 0
    out = model(input_ids=IDS, attention_mask=MASK).logits.sum()
    out.backward()
    tisa = [m for m in model.modules() if getattr(m, "name", "") == "tisa"]
    assert len(tisa) == 2 and all(float(t.a.grad.abs().sum()) > 0 for t in tisa)


def test_qkv_mechanisms_and_composites_on_bert():
    model = tiny("bert")
    before = logits(model)
    add_mechanisms(model, ["rope", "composite"], mode="supplement", init="default")
    after = logits(model)
    assert after.isfinite().all() and not torch.allclose(after, before)


def test_fit_initialises_kernels_from_the_checkpoint(tmp_path):
    model = tiny("bert")
    model.bert.save_pretrained(tmp_path)
    fit = fit_kernels(tmp_path, n_kernels=2, positions=12, restarts=1, adam_steps=20, lbfgs_steps=5)
    assert isinstance(fit, TisaFit) and fit.a.shape == (2, 4, 2)
    add_mechanisms(model, [{"name": "tisa", "n_kernels": 2}], mode="replace", init=fit)
    tisa = model.bert.encoder.layer[1].attention.self.position_mechanisms[0]
    torch.testing.assert_close(tisa.c.detach().double(), torch.as_tensor(fit.c[1]), atol=1e-6, rtol=0)


def test_clear_errors():
    with pytest.raises(PositionError, match="not supported"):
        add_mechanisms(tf.DistilBertModel(tf.DistilBertConfig(dim=16, n_heads=2, n_layers=1, hidden_dim=32)), ["tisa"])
    with pytest.raises(PositionError, match="score-level mechanisms only"):
        add_mechanisms(tiny("mpnet"), ["rope"])
    with pytest.raises(PositionError, match="acts on the input"):
        add_mechanisms(tiny("bert"), ["absolute"], mode="replace")
    with pytest.raises(PositionError, match="disagrees"):
        add_mechanisms(tiny("bert"), [{"name": "tisa", "mode": "replace"}], mode="supplement")
    with pytest.raises(PositionError, match="acts on the input"):
        add_mechanisms(tiny("bert"), ["sinusoidal"])
    with pytest.raises(PositionError, match="tisa is not among"):
        z = np.zeros((2, 4))
        add_mechanisms(tiny("bert"), ["t5"], init=TisaFit(*(np.zeros((2, 4, 3)),) * 3, z, 8, 4, z, z, z))
    with pytest.raises(PositionError, match="init='zero' needs a neutral start, which alibi, rope does not"):
        add_mechanisms(tiny("bert"), ["t5", "alibi", "rope"], init="zero")
    with pytest.raises(PositionError, match="init must be left out, 'zero', 'default' or a TisaFit"):
        add_mechanisms(tiny("bert"), ["t5"], init="neutral")
    model = add_mechanisms(tiny("bert"), ["tisa"])
    with pytest.raises(PositionError, match="already has"):
        add_mechanisms(model, ["alibi"], init="default")


@pytest.mark.parametrize("family", ["bert", "mpnet"])
def test_save_and_load_retrofitted(family, tmp_path):
    from posattn.hf.retrofit import load_retrofitted

    model = add_mechanisms(tiny(family), ["tisa", "t5"] if family == "bert" else ["tisa"], mode="replace")
    model.save_pretrained(tmp_path)
    back = load_retrofitted(tmp_path, type(model)).eval()
    torch.testing.assert_close(logits(back), logits(model), atol=0, rtol=0)
    tiny(family).save_pretrained(tmp_path / "plain")
    with pytest.raises(PositionError, match="no posattn_retrofit"):
        load_retrofitted(tmp_path / "plain", type(model))


def test_a_mixer_is_applied_in_place_of_softmax_attention():
    """A mixer replaces softmax(s)·V in the retrofitted attention: LinCAT's linear attention
    changes the function, and its reference and fast paths agree."""
    before = logits(tiny("bert"))
    mixed = {path: logits(add_mechanisms(tiny("bert"), ["lincat"], init="default", path=path))
             for path in ("reference", "fast")}
    torch.testing.assert_close(mixed["fast"], mixed["reference"], atol=1e-5, rtol=1e-5)
    assert mixed["fast"].isfinite().all() and not torch.allclose(mixed["fast"], before, atol=1e-3)


def test_a_mixer_the_structure_cannot_run_is_refused_by_name():
    with pytest.raises(PositionError, match="lincat transform q/k/v or the output, or replace softmax"):
        add_mechanisms(tiny("mpnet"), ["lincat"], init="default")
    for name in ("convbert", "conv_qkv"):
        with pytest.raises(PositionError, match=f"{name} reads the layer's input x"):
            add_mechanisms(tiny("bert"), [name], init="default")
