"""Parallel text for the seq2seq experiment: verse-aligned English (KJV) / Spanish (Reina-Valera
1909) Bible pairs, staged by ``hpclb data fetch bible-en-es`` as ``pairs.tsv``.

Both SWORD modules (Debian ``sword-text-kjv``: engKJV2006eb, ``sword-text-sparv``: spaRV1909eb)
use the KJV versification, so verse slot ``i`` of one is the same verse of the other. Lines of
``pairs.tsv``: ``book<TAB>chapter<TAB>verse<TAB>english<TAB>spanish`` (UTF-8; whitespace
collapsed, the pilcrow removed); verses empty in either module are left out (31,084 pairs of
31,102 slots). Split by book (:data:`TEST_BOOKS`, :data:`VALID_BOOKS`) so test text is unseen.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hpclb.data.paths import data_dir
from hpclb.errors import DataError

__all__ = ["BOS", "EOS", "MODULES", "NUM_PAIRS", "PACKAGES", "PAD", "TEST_BOOKS", "UNK",
           "VALID_BOOKS", "Pair", "bleu", "clean", "load_bible_pairs", "read_sword_pairs",
           "train_sentencepiece", "write_pairs"]

MODULES = {"en": "engKJV2006eb", "es": "spaRV1909eb"}
PACKAGES = ("sword-text-kjv", "sword-text-sparv")
NUM_PAIRS = 31_084
TEST_BOOKS = ("Ruth", "Jonah", "Galatians", "James")            # 389 pairs
VALID_BOOKS = ("Esther", "Philippians", "I John")  # pysword book names


@dataclass(frozen=True)
class Pair:
    """One verse-aligned sentence pair: KJV book, chapter and verse, English and Spanish text."""

    book: str
    chapter: int
    verse: int
    en: str
    es: str


def clean(text: str) -> str:
    """Verse text as stored: pilcrows dropped, whitespace collapsed, stripped."""
    return re.sub(r"\s+", " ", text.replace("\u00b6", " ")).strip()


def read_sword_pairs(sword_root: str | Path) -> list[Pair]:
    """All verse pairs of the two modules under ``sword_root`` (holding ``mods.d`` and
    ``modules``), in canonical order, read with pysword. Raises DataError when a module is
    missing or the two disagree on a book's number of verses."""
    from hpclb.extras import require

    SwordModules = require("pysword.modules", "reading the Bible SWORD modules").SwordModules

    modules = SwordModules(str(sword_root))
    found = modules.parse_modules()
    for lang, name in MODULES.items():
        if name not in found:
            raise DataError(f"{sword_root}: SWORD module {name} ({lang}) not found; is "
                            f"{PACKAGES[0 if lang == 'en' else 1]} installed/extracted there?")
    en = modules.get_bible_from_module(MODULES["en"])
    es = modules.get_bible_from_module(MODULES["es"])
    books = en.get_structure().get_books()
    pairs = []
    for testament in ("ot", "nt"):
        for book in books[testament]:
            e = list(en.get_iter(books=[book.osis_name], clean=True))
            s = list(es.get_iter(books=[book.osis_name], clean=True))
            if len(e) != len(s):
                raise DataError(f"{book.name}: {len(e)} English but {len(s)} Spanish verses")
            slots = [(c + 1, v + 1) for c, n in enumerate(book.chapter_lengths) for v in range(n)]
            for (chapter, verse), a, b in zip(slots, e, s):
                a, b = clean(a), clean(b)
                if a and b:
                    pairs.append(Pair(book.name, chapter, verse, a, b))
    return pairs


def write_pairs(path: Path, pairs: list[Pair]) -> None:
    """Write ``pairs`` to ``path`` as tab-separated lines (book, chapter, verse, en, es).

    Atomic: written to ``<path>.part`` and renamed, so a reader never sees a partial file."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        for p in pairs:
            f.write(f"{p.book}\t{p.chapter}\t{p.verse}\t{p.en}\t{p.es}\n")
    tmp.replace(path)


def load_bible_pairs(root: str | Path | None = None) -> dict[str, list[Pair]]:
    """``{"train", "valid", "test"}`` pair lists from ``<data dir>/bible-en-es/pairs.tsv``, split
    by book. Raises DataError for a missing or malformed file."""
    base = data_dir(root)
    path = (base / "bible-en-es" if (base / "bible-en-es").is_dir() else base) / "pairs.tsv"
    if not path.is_file():
        raise DataError(f"{path}: no such file; stage it with `hpclb data fetch bible-en-es`")
    splits: dict[str, list[Pair]] = {"train": [], "valid": [], "test": []}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        f = line.split("\t")
        if len(f) != 5:
            raise DataError(f"{path}:{n}: expected 5 tab-separated fields, got {len(f)}")
        p = Pair(f[0], int(f[1]), int(f[2]), f[3], f[4])
        split = "test" if p.book in TEST_BOOKS else "valid" if p.book in VALID_BOOKS else "train"
        splits[split].append(p)
    return splits


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (sacrebleu, default 13a tokenisation), 0-100, one reference per sentence."""
    from hpclb.extras import require

    sacrebleu = require("sacrebleu", "BLEU")
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


PAD, UNK, BOS, EOS = 0, 1, 2, 3


def train_sentencepiece(lines: list[str], vocab_size: int):
    """A unigram SentencePiece model trained in memory on ``lines`` (deterministic: one thread),
    with ids pad 0, unk 1, bos 2, eos 3. Every rank trains the same model; nothing is written."""
    import io

    from hpclb.extras import require

    spm = require("sentencepiece", "the translation vocabulary (SentencePiece)")

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS,
        eos_id=EOS, num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())
