"""GNMT-style model shapes (the seq2seq data pipeline is not implemented yet, see gnmt.yaml)."""
import pytest
import torch

from hpclb.config import ConfigError, load_recipe, resolve
from hpclb.models import GNMT


def test_gnmt_shapes_masking_and_greedy():
    torch.manual_seed(0)
    m = GNMT(src_vocab=30, tgt_vocab=40, hidden_size=16, encoder_layers=4, decoder_layers=4)
    src = torch.randint(3, 30, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    logits = m(src, mask, torch.randint(3, 40, (2, 5)))
    assert logits.shape == (2, 5, 40)
    m.eval()
    a = m(src, mask, torch.ones(2, 3, dtype=torch.int64))
    src2 = src.clone()
    src2[1, 5:] = 0  # padding content must not matter
    b = m(src2, mask, torch.ones(2, 3, dtype=torch.int64))
    assert torch.allclose(a, b, atol=1e-6)
    out = m.greedy(src, mask, bos=1, eos=2, max_len=6)
    assert out.shape[0] == 2 and out.shape[1] <= 6 and out.dtype == torch.int64
    with pytest.raises(ValueError):
        GNMT(hidden_size=15)


def test_gnmt_recipe_validates_but_training_is_refused(tmp_path):
    r = load_recipe("gnmt")
    assert (r["base_batch_size"], r["data"]["name"], r["task"]) == (128, "bible-en-es", "seq2seq")
    from hpclb import train as train_mod
    from hpclb.comm import SelfCommunicator
    with pytest.raises(ConfigError, match="not implemented"):
        train_mod.train(resolve("gnmt", out=str(tmp_path / "g")), SelfCommunicator(), quiet=True)
