"""GNMT-style model (shapes, greedy and beam-search decoding), seq2seq recipes, BLEU and data."""
import functools

import pytest
import torch

from hpclb.config import load_recipe, resolve
from hpclb.errors import ConfigError
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
        from pathlib import Path

        import yaml
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
    """A tiny GNMT on 256 real verse pairs, 2 epochs: loss, perplexity and BLEU (of beam-2
    translations) are reported."""
    import os
    from pathlib import Path

    import yaml
    from conftest import REPO

    from hpclb.comm.local import SelfCommunicator
    from hpclb.train import loop as train_mod
    base = Path(os.environ.get("HPCLB_DATA", REPO / "data"))
    if not (base / "bible-en-es" / "pairs.tsv").is_file():
        pytest.skip(f"bible-en-es not staged in {base}; run `make data`")
    r = load_recipe("gnmt-cpu")
    r.update({"data": {"name": "bible-en-es", "vocab_size": 300, "max_length": 20,
                       "eval_samples": 16, "train_samples": 256, "test_samples": 16,
                       "beam_size": 2},
              "model": {"name": "gnmt", "encoder_layers": 2, "decoder_layers": 2,
                        "hidden_size": 32, "dropout": 0.0}, "epochs": 2, "warmup_epochs": 0.25})
    p = tmp_path / "g.yaml"
    p.write_text(yaml.safe_dump(r))
    s = train_mod.train(resolve(str(p), batch_size=64, data_dir=str(base),
                                out=str(tmp_path / "o")), SelfCommunicator(), quiet=True)
    assert s["task"] == "seq2seq" and s["steps"] == 8
    assert 0 <= s["final_test_bleu"] <= 100 and s["final_test_loss"] < 10
    assert s["decoding"] == "beam 2, length penalty 0.6"


# --- beam search (GNMT.beam_search) on small seeded models ------------------------------------

BOS, EOS, PAD, TOY_VOCAB = 2, 3, 0, 12  # the ids of hpclb.data.translation


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread (and do not fight a busy machine's other work)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _toy_sentences(seed: int, n: int, lo: int = 2, hi: int = 8):
    """``n`` random source sentences of ``lo..hi`` tokens (ids 4..), right-padded with PAD:
    ``(src int64 [n, s], mask bool [n, s])``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g)
    mask = torch.arange(int(lengths.max()))[None] < lengths[:, None]
    src = torch.randint(4, TOY_VOCAB, mask.shape, generator=g).masked_fill(~mask, PAD)
    return src, mask


@functools.lru_cache(maxsize=None)
def _toy_gnmt(train_steps: int) -> GNMT:
    """A seeded 2+2 x 32 GNMT (eval mode). ``train_steps`` > 0: that many Adam steps (about a
    second) on copying the source, so that where it says EOS depends on the input; an untrained
    one mostly says EOS at once or never."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    m = GNMT(src_vocab=TOY_VOCAB, tgt_vocab=TOY_VOCAB, hidden_size=32, encoder_layers=2,
             decoder_layers=2, dropout=0.0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for step in range(train_steps):
        src, mask = _toy_sentences(1000 + step, 32)
        tgt = [s[m_].tolist() for s, m_ in zip(src, mask)]
        width = max(map(len, tgt)) + 1
        tgt_in = torch.tensor([[BOS] + y + [PAD] * (width - 1 - len(y)) for y in tgt])
        tgt_out = torch.tensor([y + [EOS] + [PAD] * (width - 1 - len(y)) for y in tgt])
        loss = F.cross_entropy(m(src, mask, tgt_in).reshape(-1, TOY_VOCAB), tgt_out.reshape(-1),
                               ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@torch.no_grad()
def _penalised_log_probs(m, src, mask, ys: list[list[int]], alpha: float) -> list[float]:
    """GNMT's ``log P(y | src) / ((5 + |y|) / 6) ** alpha`` of each ``y`` in ``ys`` (cut after
    its first EOS; ``|y|`` counts the EOS), by teacher-forcing them through ``m`` in one batch;
    one source sentence, ``src`` ``[1, s]``."""
    ys = [y[:y.index(EOS) + 1] if EOS in y else y for y in ys]
    width = max(map(len, ys))
    tgt_in = torch.tensor([[BOS] + y[:-1] + [PAD] * (width - len(y)) for y in ys])
    n = len(ys)
    logp = torch.log_softmax(m(src.expand(n, -1), mask.expand(n, -1), tgt_in), -1)
    return [logp[j, torch.arange(len(y)), torch.tensor(y)].sum().item()
            / ((5 + len(y)) / 6) ** alpha for j, y in enumerate(ys)]


def _one(src, mask, i):
    """Sentence ``i`` of a padded batch, alone and unpadded: ``[1, its length]``."""
    n = int(mask[i].sum())
    return src[i:i + 1, :n], mask[i:i + 1, :n]


@pytest.mark.parametrize("train_steps", [0, 40])
def test_beam_size_1_is_greedy(one_thread, train_steps):
    m = _toy_gnmt(train_steps)
    src, mask = _toy_sentences(1, 16)
    greedy = m.greedy(src, mask, bos=BOS, eos=EOS, max_len=12)
    for alpha in (0.0, 0.6):
        beam = m.beam_search(src, mask, bos=BOS, eos=EOS, beam_size=1, max_len=12,
                             length_penalty=alpha)
        assert beam.dtype == torch.int64 and torch.equal(beam, greedy)


@pytest.mark.parametrize("train_steps", [0, 40])
def test_beam_scores_at_least_greedy(one_thread, train_steps):
    """Summed over 16 sentences, the beam's translations have length-penalised log-probabilities
    >= greedy's. Not asserted per sentence: beam search can prune the greedy path and end below
    it (a search error; with this model on other seeds, about 2 % of sentences at beam 4)."""
    m = _toy_gnmt(train_steps)
    src, mask = _toy_sentences(2, 16)
    greedy = m.greedy(src, mask, bos=BOS, eos=EOS, max_len=12).tolist()
    for alpha in (0.0, 0.6, 1.0):
        beam = m.beam_search(src, mask, bos=BOS, eos=EOS, beam_size=4, max_len=12,
                             length_penalty=alpha).tolist()
        b = g = 0.0
        for i in range(len(beam)):
            b_i, g_i = _penalised_log_probs(m, *_one(src, mask, i), [beam[i], greedy[i]], alpha)
            b, g = b + b_i, g + g_i
        assert b >= g - 1e-4, (alpha, b, g)
        if train_steps:
            assert b > g + 0.1  # the beam finds translations greedy misses


def test_wide_beam_is_exhaustive_search(one_thread):
    """With ``beam_size`` >= V ** (max_len - 1) no prefix is ever pruned, so the answer must be
    the best of all sequences of <= max_len tokens (ending in EOS or cut at max_len) under
    GNMT's penalised score, for every alpha: that checks the scores, the length penalty (short
    sources, so that lengths 1, 2 and 3 compete as alpha grows) and the bookkeeping."""
    import itertools
    m, v, max_len = _toy_gnmt(40), TOY_VOCAB, 3
    words = [t for t in range(v) if t != EOS]
    every = [[EOS]] + [[a, EOS] for a in words] + \
        [[a, b, c] for a, b in itertools.product(words, words) for c in range(v)]
    lp = torch.tensor([(5 + len(y)) / 6 for y in every], dtype=torch.float64)
    src, mask = _toy_sentences(3, 6, lo=1, hi=3)
    log_probs = torch.tensor([_penalised_log_probs(m, *_one(src, mask, i), every, 0.0)
                              for i in range(len(src))], dtype=torch.float64)
    lengths = set()
    for alpha in [0.25 * j for j in range(13)]:
        best = (log_probs / lp ** alpha).argmax(1).tolist()
        out = m.beam_search(src, mask, bos=BOS, eos=EOS, beam_size=v ** (max_len - 1),
                            max_len=max_len, length_penalty=alpha).tolist()
        for i, j in enumerate(best):
            y = every[j]
            assert out[i][:len(y)] == y and set(out[i][len(y):]) <= {EOS}, (alpha, i, out[i], y)
            lengths.add(len(y))
    assert lengths == {2, 3}  # the penalty decided between lengths


def test_beam_batch_equals_one_at_a_time(one_thread):
    """Sentences of 2..8 tokens decoded in one padded batch give what each gives alone (padded
    with EOS to the batch's longest translation, as greedy pads)."""
    m = _toy_gnmt(40)
    src, mask = _toy_sentences(4, 10)
    assert len(set(mask.sum(1).tolist())) > 3
    together = m.beam_search(src, mask, bos=BOS, eos=EOS, beam_size=4, max_len=12)
    alone = [m.beam_search(*_one(src, mask, i), bos=BOS, eos=EOS, beam_size=4, max_len=12)[0]
             for i in range(len(src))]
    assert together.shape == (len(src), max(len(y) for y in alone))
    assert len({len(y) for y in alone}) > 1  # translations of different lengths, too
    for row, y in zip(together, alone):
        assert torch.equal(row[:len(y)], y) and bool((row[len(y):] == EOS).all())


def test_beam_search_rejects_bad_arguments():
    m = _toy_gnmt(0)
    src, mask = _toy_sentences(5, 2)
    for bad in ({"beam_size": 0}, {"beam_size": -2}, {"beam_size": 2.0}, {"beam_size": True},
                {"max_len": 0}, {"length_penalty": -0.1}, {"length_penalty": float("nan")}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            m.beam_search(src, mask, bos=BOS, eos=EOS, **bad)


def test_recipes_choose_the_decoder(tmp_path):
    """Packaged: gnmt decodes with beam 10 (GNMT's), gnmt-cpu with beam 4; a bad beam_size or
    length_penalty is a ConfigError naming the field before anything is trained."""
    import yaml
    assert load_recipe("gnmt")["data"]["beam_size"] == 10
    assert load_recipe("gnmt-cpu")["data"]["beam_size"] == 4
    r = load_recipe("gnmt-cpu")
    p = tmp_path / "r.yaml"
    for field, value, ok in (("beam_size", 1, True), ("beam_size", 0, False),
                             ("beam_size", 2.5, False), ("beam_size", "4", False),
                             ("length_penalty", 0, True), ("length_penalty", 1.2, True),
                             ("length_penalty", -0.6, False), ("length_penalty", None, False)):
        p.write_text(yaml.safe_dump(dict(r, data={**r["data"], field: value})))
        if ok:
            assert load_recipe(str(p))["data"][field] == value
        else:
            with pytest.raises(ConfigError, match=f"data.{field}: must be"):
                resolve(str(p))


def test_seq2seq_evaluation_uses_the_recipes_decoder(one_thread, monkeypatch):
    """Seq2seqTask.evaluate calls greedy for beam_size 1, else beam_search with the recipe's
    beam_size and length_penalty (tiny synthetic pairs, untrained model)."""
    import random

    from hpclb.comm.local import SelfCommunicator
    from hpclb.tasks import Seq2seqTask
    en = "the cat dog sat ran on a mat home and big small".split()
    es = "el gato perro se sento corrio en una casa y grande chico".split()
    rng = random.Random(0)
    rows = [[rng.randrange(len(en)) for _ in range(rng.randint(2, 6))] for _ in range(206)]
    pairs = [(" ".join(en[j] for j in r), " ".join(es[j] for j in r)) for r in rows]
    pairs = {"train": pairs[:200], "test": pairs[200:]}
    calls = []
    for name in ("greedy", "beam_search"):
        real = getattr(GNMT, name)
        monkeypatch.setattr(GNMT, name, lambda self, *a, _real=real, _name=name, **kw: (
            calls.append((_name, kw)), _real(self, *a, **kw))[1])
    for beam, decoding in ((1, "greedy"), (3, "beam 3, length penalty 0.5")):
        task = Seq2seqTask(pairs, vocab_size=28, max_length=10, eval_samples=6, beam_size=beam,
                           length_penalty=0.5)
        assert task.decoding == decoding
        torch.manual_seed(0)
        m = GNMT(hidden_size=16, encoder_layers=2, decoder_layers=2, **task.model_kwargs)
        calls.clear()
        metrics = task.evaluate(m, SelfCommunicator())
        assert 0 <= metrics["test_bleu"] <= 100
        if beam == 1:
            assert [c[0] for c in calls] == ["greedy"]
        else:
            assert calls == [("beam_search", {"bos": BOS, "eos": EOS, "beam_size": 3,
                                              "max_len": 11, "length_penalty": 0.5})]
