"""F̂_P (TISA Eq 9-12) of a tiny BERT-format checkpoint against a hand computation."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from posattn.analysis.hf import CheckpointError, HFCheckpoint, t5_bidirectional_bucket
from posattn.analysis.native import open_source
from posattn.analysis.profiles import hf_profiles

from .conftest import LAYERS, N_POS, D, H, write_bert


def hand_fhat(t, layer, n, layer_norm=True):
    """Straight from the definition, one entry at a time."""
    w_bar = t["embeddings.word_embeddings.weight"].mean(0)
    t0 = t.get("embeddings.token_type_embeddings.weight", np.zeros((1, D)))[0]
    g, b = t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"]
    pre = f"encoder.layer.{layer}.attention.self."
    wq, bq = t[pre + "query.weight"], t[pre + "query.bias"]
    wk, bk = t[pre + "key.weight"], t[pre + "key.bias"]
    dh = D // H
    out = np.zeros((H, n, n))
    for i in range(n):
        for j in range(n):
            xi = w_bar + t0 + t["embeddings.position_embeddings.weight"][i]
            xj = w_bar + t0 + t["embeddings.position_embeddings.weight"][j]
            if layer_norm:
                xi = (xi - xi.mean()) / np.sqrt(xi.var() + 1e-12) * g + b
                xj = (xj - xj.mean()) / np.sqrt(xj.var() + 1e-12) * g + b
            qi, kj = wq @ xi + bq, wk @ xj + bk  # nn.Linear: y = W x + b
            for h in range(H):
                sl = slice(h * dh, (h + 1) * dh)
                out[h, i, j] = qi[sl] @ kj[sl] / np.sqrt(dh)
    return out


def test_fhat_equals_hand_computation(bert_folder):
    folder, t = bert_folder
    prof = hf_profiles(HFCheckpoint.open(folder), n=N_POS)
    assert prof.scores.shape == (LAYERS, H, N_POS, N_POS)
    for layer in range(LAYERS):
        assert np.allclose(prof.scores[layer], hand_fhat(t, layer, N_POS), atol=1e-10)


def test_literal_eq12_without_layer_norm(tmp_path):
    t = write_bert(tmp_path / "b", token_types=False, biases=False)
    prof = hf_profiles(HFCheckpoint.open(tmp_path / "b"), n=6, layer_norm=False)
    e_p, w_bar = t["embeddings.position_embeddings.weight"][:6], t["embeddings.word_embeddings.weight"].mean(0)
    dh = D // H
    for layer in range(LAYERS):
        pre = f"encoder.layer.{layer}.attention.self."
        wq, wk = t[pre + "query.weight"].T, t[pre + "key.weight"].T  # x @ W form
        for h in range(H):
            wq_h, wk_h = wq[:, h * dh:(h + 1) * dh], wk[:, h * dh:(h + 1) * dh]
            m = wq_h @ wk_h.T
            eq12 = (w_bar[None] @ m @ e_p.T + e_p @ m @ w_bar[:, None] + e_p @ m @ e_p.T) / np.sqrt(dh)
            assert np.allclose(prof.scores[layer, h], eq12, atol=1e-10)


def test_prefixed_keys_and_padding_offset(tmp_path):
    t = write_bert(tmp_path / "r", model_type="roberta")
    # a RoBERTa-style checkpoint inside a task model: every name prefixed, positions start at pad + 1
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "r" / "model.safetensors"))
    save_file({f"roberta.{k}": v for k, v in state.items()}, str(tmp_path / "r" / "model.safetensors"))
    ckpt = HFCheckpoint.open(tmp_path / "r")
    assert ckpt.prefix == "roberta."
    assert np.allclose(ckpt.position_embeddings().numpy(), t["embeddings.position_embeddings.weight"][1:])


def test_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a Hugging Face checkpoint .* nor a posattn checkpoint"):
        open_source(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no such folder"):
        open_source(tmp_path / "missing")
    folder = tmp_path / "nopos"
    write_bert(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "relative_key"}))
    with pytest.raises(CheckpointError, match="no learned absolute position embeddings"):
        HFCheckpoint.open(folder).position_embeddings()
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(CheckpointError, match="not supported"):
        hf_profiles(HFCheckpoint.open(folder), n=4)


def test_mpnet_buckets_match_the_reference_rule():
    # MPNet/T5 bidirectional buckets, 32 buckets, max distance 128: exact below 8, log-spaced to 15
    r = torch.tensor([-200, -128, -20, -8, -7, -1, 0, 1, 7, 8, 20, 128, 200])
    got = t5_bidirectional_bucket(r, 32, 128).tolist()
    assert got == [15, 15, 10, 8, 7, 1, 0, 17, 23, 24, 26, 31, 31]
