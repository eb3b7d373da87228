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


def test_gnmt_recipes_validate():
    r = load_recipe("gnmt")
    assert (r["base_batch_size"], r["data"]["name"], r["task"]) == (128, "bible-en-es", "seq2seq")
    assert r["model"]["hidden_size"] == 1024 and load_recipe("gnmt-cpu")["task"] == "seq2seq"
    with pytest.raises(ConfigError, match="data.source"):
        import yaml
        from pathlib import Path
        bad = dict(r, data={"name": "bible-en-es", "source": "fr"})
        p = Path(__import__("tempfile").mkdtemp()) / "bad.yaml"
        p.write_text(yaml.safe_dump(bad))
        load_recipe(str(p))


def test_bleu_of_known_pairs():
    from hpclb.data.translation import bleu
    assert bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(100.0)
    # p1..p4 = 6/7, 5/6, 4/5, 3/4, no brevity penalty (hypothesis longer): (3/7) ** (1/4)
    assert bleu(["the cat sat on the mat today"], ["the cat sat on the mat"]) == \
        pytest.approx(100 * (3 / 7) ** 0.25, abs=0.01)


def test_bible_pairs_real_files():
    import os
    from pathlib import Path
    from conftest import REPO
    from hpclb.data.translation import TEST_BOOKS, load_bible_pairs
    base = Path(os.environ.get("HPCLB_DATA", REPO / "data"))
    if not (base / "bible-en-es" / "pairs.tsv").is_file():
        pytest.skip(f"bible-en-es not staged in {base}; run `make data`")
    s = load_bible_pairs(base)
    assert sum(len(v) for v in s.values()) == 31_084 > 30_000
    assert len(s["test"]) == 389 and len(s["valid"]) > 300
    assert {p.book for p in s["test"]} == set(TEST_BOOKS)
    assert not {p.book for p in s["train"]} & {p.book for p in s["test"] + s["valid"]}
    first = s["train"][0]
    assert (first.book, first.chapter, first.verse) == ("Genesis", 1, 1)
    assert first.en.startswith("In the beginning God created") and "principio" in first.es


@pytest.mark.slow
def test_seq2seq_trains_and_scores_bleu(tmp_path):
    """A tiny GNMT on 256 real verse pairs, 2 epochs: loss, perplexity and BLEU are reported."""
    import os
    from pathlib import Path

    import yaml
    from conftest import REPO
    from hpclb import train as train_mod
    from hpclb.comm import SelfCommunicator
    base = Path(os.environ.get("HPCLB_DATA", REPO / "data"))
    if not (base / "bible-en-es" / "pairs.tsv").is_file():
        pytest.skip(f"bible-en-es not staged in {base}; run `make data`")
    r = load_recipe("gnmt-cpu")
    r.update({"data": {"name": "bible-en-es", "vocab_size": 300, "max_length": 20,
                       "eval_samples": 16, "train_samples": 256, "test_samples": 16},
              "model": {"name": "gnmt", "encoder_layers": 2, "decoder_layers": 2,
                        "hidden_size": 32, "dropout": 0.0}, "epochs": 2, "warmup_epochs": 0.25})
    p = tmp_path / "g.yaml"
    p.write_text(yaml.safe_dump(r))
    s = train_mod.train(resolve(str(p), batch_size=64, data_dir=str(base),
                                out=str(tmp_path / "o")), SelfCommunicator(), quiet=True)
    assert s["task"] == "seq2seq" and s["steps"] == 8
    assert 0 <= s["final_test_bleu"] <= 100 and s["final_test_loss"] < 10
