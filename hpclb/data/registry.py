"""The data sets hpclb knows, by name: the one place a data set is declared.

Each :class:`DataSet` names its reader, its fetcher (``hpclb data fetch``), its published
training-set size (``hpclb jobs``), and the task kinds that read it (:mod:`hpclb.tasks`). Readers
and fetchers are ``"package.module:attribute"`` strings or functions that import torch only when
called, so this module (and ``hpclb --help``) loads without torch.

A reader is called as ``loader(root, data)``: ``root`` the data directory given on the command
line (None: :func:`~hpclb.data.paths.data_dir`'s default), ``data`` the recipe's data section
(a :class:`~hpclb.tasks.spec.DataSpec` or a dict: ``data.get(key, default)``). It returns what
its task kind reads: ``(train, test)`` splits for ``classification`` (each with ``len()``,
``subset(n)``, ``batch(indices) -> (x, y)``), a :class:`~hpclb.data.ptb.Corpus` for
``language_model``, ``{"train": [...], "test": [...]}`` sentence pairs for ``seq2seq``.

Each also names the files its reader reads (``files``): what the ranks compare before training
and ``--resume`` compares with the checkpoint's (:meth:`DataSet.fingerprint`).

To add a data set, call :func:`register_dataset` (see tests/test_registry.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from hpclb.data.manifest import check_manifest, fingerprint_files
from hpclb.data.paths import data_dir
from hpclb.errors import ConfigError, DataError
from hpclb.plugins import Registry, is_plugin, resolve_ref

__all__ = ["DATASETS", "DataSet", "check_subset", "data_dir", "dataset", "fetchable",
           "register_dataset", "subset_splits", "train_set_sizes"]


def check_subset(field: str, n: int | None, size: int, split: str,
                 unit: str = "samples") -> None:
    """ConfigError naming ``field`` (``data.train_samples``: the first ``n`` samples, a subset)
    when ``n`` is more than the ``size`` ``unit`` that ``split`` holds: a subset cannot be
    larger than its set (it used to be cut to the set, silently)."""
    if n and n > size:
        raise ConfigError(f"{field} {n}: more than the {size} {unit} of {split}; it takes the "
                          f"first N of them: set {field} to {size} or less, or remove it to use "
                          f"the whole split")


def subset_splits(train, test, train_samples: int | None, test_samples: int | None, name: str,
                  prefix: str = "data.") -> tuple:
    """``(train, test)`` cut to their first ``train_samples`` / ``test_samples`` (None or 0:
    the whole split); ConfigError (:func:`check_subset`, naming ``<prefix>train_samples`` or
    ``<prefix>test_samples`` and ``name``'s split) when one is more than its split holds."""
    check_subset(f"{prefix}train_samples", train_samples, len(train), f"{name}'s training split")
    check_subset(f"{prefix}test_samples", test_samples, len(test), f"{name}'s test split")
    return (train.subset(train_samples) if train_samples else train,
            test.subset(test_samples) if test_samples else test)


@dataclass(frozen=True)
class DataSet:
    """One data set. ``train_size`` (in ``unit``: images, tokens, sentence pairs) and ``source``
    are the published numbers ``hpclb jobs`` plans with on a login node that may not hold the
    data; None when unknown. ``options``: data-section keys only this data set's reader takes
    (other data sets reject them). ``fetcher(root) -> Path`` stages it, None: not fetchable.
    ``files``: the files the reader reads, as glob patterns relative to the set's directory
    (:meth:`directory`) -> how each is digested (``sha256``, ``stamp``, ``size``:
    :func:`~hpclb.data.manifest.fingerprint_files`), or a function of the data section
    returning them; None: unknown, every file under the directory is fingerprinted
    (up to 10,000, by size and first and last 64 KiB)."""

    name: str
    loader: Callable | str
    tasks: tuple[str, ...]
    train_size: int | None = None
    unit: str = "samples"
    source: str = ""
    fetcher: Callable | str | None = None
    options: tuple[str, ...] = ()
    files: Mapping[str, str] | Callable[[Any], Mapping[str, str]] | None = None

    def directory(self, root) -> Path:
        """Where the reader finds the set under data directory ``root``: ``<root>/<name>``
        when that is a folder, else ``root`` itself (which then holds the files)."""
        staged = data_dir(root) / self.name
        return staged if staged.is_dir() else data_dir(root)

    def load(self, root, data) -> Any:
        """What the reader returns for data section ``data`` read from ``root``, after the
        files ``hpclb data fetch`` recorded for it (``<root>/<name>/.verified``) are checked
        again (:func:`~hpclb.data.manifest.check_manifest`: DataError naming a changed file)."""
        check_manifest(self.directory(root))
        return resolve_ref(self.loader)(root, data)

    def fingerprint(self, root, data, exclude: tuple = ()) -> dict[str, str]:
        """The content of what the reader reads for ``data`` from ``root``: file name
        (relative to :meth:`directory`) -> its size and digest; nothing under ``exclude``
        (the run directory). Raises OSError."""
        files = self.files(data) if callable(self.files) else self.files
        if files is None:
            return fingerprint_files(self.directory(root), _UNKNOWN_FILES, _UNKNOWN_LIMIT,
                                     exclude)
        return fingerprint_files(self.directory(root), files, exclude=exclude)

    def fetch(self, root=None):
        if self.fetcher is None:
            raise DataError(f"data set {self.name!r} cannot be fetched; choose one of "
                            f"{sorted(fetchable())}")
        return resolve_ref(self.fetcher)(root)


DATASETS: Registry = Registry("data set")
#: what is fingerprinted of a data set whose files are unknown (a plug-in's): every file under
#: its directory, by size and its first and last 64 KiB; more than the limit: none
_UNKNOWN_FILES = {"**/*": "stamp"}
_UNKNOWN_LIMIT = 10_000


def register_dataset(ds: DataSet, *, replace: bool = False) -> DataSet:
    """Add ``ds`` to :data:`DATASETS` (ValueError if its name is taken, unless ``replace``)."""
    return DATASETS.register(ds.name, ds, replace=replace)


def _mnist(root, data):
    from hpclb.data.mnist import load_mnist

    return load_mnist(root)


def _fashion_mnist(root, data):
    from hpclb.data.images import load_fashion_mnist

    return load_fashion_mnist(root)


def _imagenet(root, data):
    from hpclb.data.images import load_imagenet

    return load_imagenet(root, augment=data.get("augment", True),
                         shards=data.get("shards", False))


def _imagenet_files(data) -> dict[str, str]:
    """ImageNet's files: the shards' index in full and each shard's ends, else every image's
    name and size (a stat each: reading 1.28 M images would cost as much as an epoch)."""
    if data.get("shards", False):
        return {"shards/*/index.npz": "sha256", "shards/*/*": "stamp"}
    return {"train/*/*": "size", "val/*/*": "size"}


def _synthetic(root, data):  # throughput runs: ImageNet-sized random images
    from hpclb.data.images import SyntheticImages

    return SyntheticImages(1_281_167, seed=0), SyntheticImages(50_000, seed=1)


def _ptb(root, data):
    from hpclb.data.ptb import load_ptb

    return load_ptb(root)


def _bible_pairs(root, data):
    from hpclb.data.translation import load_bible_pairs

    splits = load_bible_pairs(root)
    src, tgt = data.get("source", "en"), data.get("target", "es")
    return {k: [(getattr(p, src), getattr(p, tgt)) for p in v] for k, v in splits.items()}


for _ds in (
    DataSet("mnist", _mnist, ("classification",), 60_000, "images", "MNIST train split",
            "hpclb.data.fetch:fetch_mnist", files={"*-idx[13]-ubyte*": "sha256"}),
    DataSet("fashion-mnist", _fashion_mnist, ("classification",), 60_000, "images",
            "Fashion-MNIST train split", "hpclb.data.fetch:fetch_fashion_mnist",
            files={"*-idx[13]-ubyte.gz": "sha256"}),
    DataSet("imagenet", _imagenet, ("classification",), 1_281_167, "images",
            "ILSVRC-2012 train split", options=("augment", "num_workers", "shards"),
            files=_imagenet_files),
    DataSet("synthetic", _synthetic, ("classification",), 1_281_167, "images",
            "synthetic ImageNet stand-in, same size", files={}),
    DataSet("ptb", _ptb, ("language_model",), 929_589, "tokens",
            "Penn Treebank ptb.train.txt incl. <eos> (Mikolov)", "hpclb.data.fetch:fetch_ptb",
            files={"ptb.*.txt": "sha256"}),
    DataSet("bible-en-es", _bible_pairs, ("seq2seq",), 30_319, "sentence pairs",
            "train split of the KJV / RV 1909 verse pairs as hpclb's loader makes it "
            "(max_length 80)", "hpclb.data.fetch:fetch_bible_en_es",
            files={"pairs.tsv": "sha256"}),
):
    register_dataset(_ds)


def _plugin(name: str) -> DataSet:
    """A plug-in data function (``package.module:function``, :mod:`hpclb.plugins`) as a
    classification data set, read by :func:`hpclb.tasks.plugin.load_plugin_data`."""
    return DataSet(name, "hpclb.tasks.plugin:load_plugin_data", ("classification",))


def dataset(name: str) -> DataSet:
    """The registered data set ``name``, or a plug-in one; DataError for an unknown name."""
    if is_plugin(name):
        return _plugin(name)
    if name not in DATASETS:
        raise DataError(f"unknown data set {name!r}")
    return DATASETS[name]


def fetchable() -> list[str]:
    """Names of the data sets ``hpclb data fetch`` stages."""
    return [n for n, ds in DATASETS.items() if ds.fetcher is not None]


def train_set_sizes() -> dict[str, tuple[int, str, str]]:
    """Data set -> (training-set size, unit, source) for those whose size is known."""
    return {n: (ds.train_size, ds.unit, ds.source) for n, ds in DATASETS.items()
            if ds.train_size is not None}
