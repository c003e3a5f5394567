"""Cross-checks against the ``transformers`` implementations (skipped without posattn[hf])."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from posattn.analysis.hf import HFCheckpoint  # noqa: E402
from posattn.analysis.hf_forward import hf_scores  # noqa: E402
from posattn.analysis.profiles import hf_profiles  # noqa: E402


def tiny(kind: str, folder):
    torch.manual_seed(0)
    common = dict(hidden_size=16, num_attention_heads=4, num_hidden_layers=2, intermediate_size=32,
                  max_position_embeddings=40, vocab_size=50)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**common))
    else:
        model = transformers.MPNetModel(transformers.MPNetConfig(**common, relative_attention_num_buckets=32))
    with torch.no_grad():  # make biases and norms non-trivial
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


@pytest.mark.parametrize("kind", ["bert", "mpnet"])
def test_scores_match_transformers_attention(kind, tmp_path):
    model = tiny(kind, tmp_path / kind)
    ckpt = HFCheckpoint.open(tmp_path / kind)
    ids = torch.randint(3, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    ours = hf_scores(ckpt, input_ids=ids)
    with torch.no_grad():
        theirs = model.to(torch.float64)(input_ids=ids, output_attentions=True).attentions
    for s, a in zip(ours, theirs):
        assert torch.allclose(torch.softmax(s, -1), a, atol=1e-10)


@pytest.mark.parametrize("kind", ["bert", "mpnet"])
def test_embedding_method_is_exact_for_layer0(kind, tmp_path):
    tiny(kind, tmp_path / kind)
    ckpt = HFCheckpoint.open(tmp_path / kind)
    emb = hf_profiles(ckpt, n=12)
    fwd = hf_profiles(ckpt, n=12, method="forward")
    assert np.allclose(emb.scores[0], fwd.scores[0], atol=1e-10)
    assert emb.relative_bias == (kind == "mpnet")
