"""``hpclb advise RUN_DIR``: the critical batch of a B0 run trained with --noise-scale, and the
largest k at which LEGW is expected to hold (docs/science.md, "Where LEGW breaks")."""
from __future__ import annotations

import argparse
import json
import math
import sys

from hpclb.cli.common import error
from hpclb.errors import EXIT_USAGE, ConfigError, DataError

__all__ = ["HELP", "add_parser", "run"]

HELP = ("critical batch size (gradient noise scale) of a run trained with --noise-scale, and the "
        "largest k at which LEGW is expected to hold, with its reasons")


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite LR, got {text}")
    return v


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb advise`` on the top-level subparsers."""
    p = subparsers.add_parser("advise", help=HELP)
    p.add_argument("run_dir", help="a run directory written by hpclb train --noise-scale (at the "
                                   "recipe's B0 for the k_max prediction)")
    p.add_argument("--last", type=int, default=3, help="epochs to combine (default 3)")
    stable = p.add_mutually_exclusive_group()
    stable.add_argument("--lr-probe", action="store_true",
                        help="measure the largest LR that trains at B0 (short runs of the run's "
                             "recipe in this process, one per LR eta0 x 2^(j/2) up to the "
                             "largest k the budget allows; minutes), kept in RUN_DIR/lr_probe/ "
                             "and used by later calls")
    stable.add_argument("--stable-lr", type=_positive, default=None,
                        help="a stable LR at B0 measured otherwise (instead of the probe)")
    p.add_argument("--data-dir", default=None,
                   help="where the run's data is, for a training set counted by reading it "
                        "(a word-level LM's) and for --lr-probe (default: the run's own "
                        "--data-dir, else $HPCLB_DATA, else the directory the run read)")
    p.add_argument("--json", action="store_true",
                   help="print the advice, the prediction and its inputs as one JSON object "
                        "(strict JSON: an infinite B_simple, an epoch whose gradient was all "
                        "noise, is null)")
    p.set_defaults(func=run)
    return p


def _probe(args, first: dict) -> dict:
    """Run the LR probe for the B0 run ``args.run_dir`` (``first``: its prediction without
    one, for the k range), on the recipe the run recorded."""
    from pathlib import Path

    from hpclb.tools.advise import run_config
    from hpclb.tools.kmax import PROBE_DIR, run_data_dir, run_recipe
    from hpclb.tools.lr_probe import stability_probe

    run = Path(args.run_dir)
    cfg = run_config(run)
    work = run / PROBE_DIR
    top = max(r["k"] for r in first["prediction"]["rows"])
    return stability_probe(
        str(run_recipe(cfg, work)), optimizer=cfg.get("optimizer"), lr=cfg.get("lr"),
        data_dir=run_data_dir(cfg, args.data_dir), work=work,
        max_j=max(1, top.bit_length() - 1),
        record={"recipe_sha256": first["inputs"]["recipe_sha256"]},
        report=lambda p: print(f"lr probe: LR {p['lr']:.4g} (k = {p['k']}): "
                               f"{'trains' if p['trains'] else 'does not train'}: {p['why']}",
                               file=sys.stderr, flush=True))


def _strict(x):
    """``x`` with every non-finite float as None (JSON has no Infinity or NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def run(args: argparse.Namespace) -> int:
    """``hpclb advise``: critical batch, recommended batch and the k_max prediction; 2 without
    noise data or for a bad run directory."""
    from hpclb.tools.advise import format_advice
    from hpclb.tools.kmax import format_prediction, predict_for_run

    def warn(message: str) -> None:
        print(f"hpclb advise: warning: {message}", file=sys.stderr, flush=True)

    try:
        p = predict_for_run(args.run_dir, last=args.last, stable_lr=args.stable_lr,
                            warn=(lambda _: None) if args.lr_probe else warn,
                            data_dir=args.data_dir)
        if args.lr_probe and p["prediction"] is not None:
            p = predict_for_run(args.run_dir, last=args.last, probe=_probe(args, p), warn=warn,
                                data_dir=args.data_dir)
    except (ConfigError, DataError, OSError, ValueError) as e:
        error(str(e))
        return EXIT_USAGE
    if args.json:
        print(json.dumps(_strict(p), indent=2, allow_nan=False))
        return 0
    print(format_advice(p["advice"]))
    if p["prediction"] is None:
        print(f"k_max: not predicted ({p['why']})")
    else:
        print(format_prediction(p["prediction"], p["stable_from"]))
    return 0
