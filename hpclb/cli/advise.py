"""``hpclb advise RUN_DIR``: the critical batch of a B0 run trained with --noise-scale, and the
largest k at which LEGW is expected to hold (docs/science.md, "Where LEGW breaks")."""
from __future__ import annotations

import argparse
import json
import sys

from hpclb.cli.common import error
from hpclb.errors import EXIT_USAGE, ConfigError

__all__ = ["HELP", "add_parser", "run"]

HELP = ("critical batch size (gradient noise scale) of a run trained with --noise-scale, and the "
        "largest k at which LEGW is expected to hold, with its reasons")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb advise`` on the top-level subparsers."""
    p = subparsers.add_parser("advise", help=HELP)
    p.add_argument("run_dir", help="a run directory written by hpclb train --noise-scale (at the "
                                   "recipe's B0 for the k_max prediction)")
    p.add_argument("--last", type=int, default=3, help="epochs to combine (default 3)")
    p.add_argument("--lr-probe", action="store_true",
                   help="measure the largest LR that trains at B0 (short runs of the recipe in "
                        "this process, one per LR eta0 x 2^(j/2); minutes), kept in "
                        "RUN_DIR/lr_probe/ and used by later calls")
    p.add_argument("--stable-lr", type=float, default=None,
                   help="a stable LR at B0 measured otherwise (instead of the probe)")
    p.add_argument("--json", action="store_true",
                   help="print the advice, the prediction and its inputs as one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``hpclb advise``: critical batch, recommended batch and the k_max prediction; 2 without
    noise data or for a bad run directory."""
    from pathlib import Path

    from hpclb.tools.advise import (
        PROBE_DIR,
        advise,
        format_advice,
        format_prediction,
        predict_for_run,
    )

    def warn(message: str) -> None:
        print(f"hpclb advise: warning: {message}", file=sys.stderr, flush=True)

    try:
        a = advise(args.run_dir, last=args.last, warn=warn)
        probe = None
        if args.lr_probe:
            from hpclb.tools.lr_probe import stability_probe
            cfg = json.loads((Path(args.run_dir) / "config.json").read_text())
            probe = stability_probe(
                cfg["experiment"], optimizer=cfg.get("optimizer"), data_dir=cfg.get("data_root"),
                work=Path(args.run_dir) / PROBE_DIR,
                report=lambda p: print(f"lr probe: LR {p['lr']:.4g} (k = {p['k']}): "
                                       f"{'trains' if p['trains'] else 'does not train'}: "
                                       f"{p['why']}", file=sys.stderr, flush=True))
        if a["run_batch_size"] != a["base_batch_size"] and not args.json:
            print(format_advice(a))
            print("k_max: not predicted (the prediction starts from a run at the recipe's B0)")
            return 0
        p = predict_for_run(args.run_dir, last=args.last, stable_lr=args.stable_lr,
                            probe=probe, warn=warn)
    except (ConfigError, OSError, ValueError) as e:
        error(str(e))
        return EXIT_USAGE
    if args.json:
        print(json.dumps(p, indent=2))
    else:
        print(format_advice(p["advice"]))
        print(format_prediction(p["prediction"]))
    return 0
