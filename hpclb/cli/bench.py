"""``hpclb bench trust-ratio|model|allreduce|scaling|overhead|host-overhead|logging|loader``:
benchmarks.

The arguments and the drivers are the benchmark modules' own (:mod:`hpclb.bench`); this module
only registers them.
"""
from __future__ import annotations

import argparse

from hpclb.cli.common import error, setup_logging
from hpclb.errors import EXIT_USAGE, ConfigError

__all__ = ["HELP", "add_parser", "run"]

HELP = "benchmarks"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``hpclb bench`` and its benchmarks on the top-level subparsers."""
    from hpclb.bench import (
        allreduce,
        host_overhead,
        loader,
        logging_cost,
        overhead,
        projection,
        scaling,
        trust_ratio,
    )

    b = subparsers.add_parser("bench", help=HELP)
    bsub = b.add_subparsers(dest="bench_command", required=True)
    tr = bsub.add_parser("trust-ratio", help="K back-to-back fused LARS/LAMB steps: kernel time, "
                         "host overhead, bytes over copy bandwidth, vs the torch path "
                         "(ResNet-50, BERT-large shapes)")
    trust_ratio.add_arguments(tr)
    tr.set_defaults(func=run)
    # bench model|allreduce|scaling (gradient sync)
    m = bsub.add_parser("model", help="alpha-beta ring allreduce model: projected step time "
                        "and scaling efficiency at 1-1024 nodes x 4 GPUs; --simulate: checked "
                        "by a SimGrid replay of the sync schedule")
    projection.add_arguments(m)
    m.set_defaults(func=projection.run)
    a = bsub.add_parser("allreduce", help="allreduce bandwidth, GradientSync, DDP and Horovod "
                        "step times at 2 and 4 ranks (launches mpirun itself)")
    allreduce.add_run_arguments(a)
    a.set_defaults(func=allreduce.driver)
    s = bsub.add_parser("scaling", help="step time of MNIST-LSTM and ResNet-50 at 1, 2, 4 "
                        "ranks, weak and strong (launches mpirun itself)")
    scaling.add_run_arguments(s)
    s.set_defaults(func=scaling.driver)
    o = bsub.add_parser("overhead", help="hpclb train against a plain PyTorch loop (1 process) "
                        "and DDP over Gloo (2 ranks): paired whole-process runs")
    overhead.add_run_arguments(o)
    o.set_defaults(func=overhead.driver)
    h = bsub.add_parser("host-overhead", help="host time hpclb adds per step over a plain torch "
                        "loop: tiny model, 16 and 160 tensors, SGD/Adam/LARS/LAMB, 1 process "
                        "and 2 ranks (launches mpirun itself)")
    host_overhead.add_run_arguments(h)
    h.set_defaults(func=host_overhead.driver)
    # bench logging (per-step logging cost, issue #13)
    lc = bsub.add_parser("logging", help="per-step logging and noise-scale cost: 2-rank "
                         "MNIST-LSTM runs with --log-every 50 / 0 / --noise-scale, alternated")
    logging_cost.add_run_arguments(lc)
    lc.set_defaults(func=logging_cost.driver)
    _guard_outputs(tr, m, a, s, o, h, lc, _add_loader(bsub, loader))
    return b


def _add_loader(bsub, loader) -> argparse.ArgumentParser:
    ld = bsub.add_parser("loader", help="images/s per core of the ImageNet train and eval "
                         "transforms (DCT-scaled decode, uint8) against the path before, on "
                         "synthetic ImageNet-sized JPEGs; writes results/bench_loader.json")
    loader.add_run_arguments(ld)
    ld.set_defaults(func=loader.driver)
    return ld


def _guard_outputs(*subs: argparse.ArgumentParser) -> None:
    """Give each benchmark ``--overwrite`` and the check that its ``--out`` is not replaced
    without it."""
    for sub in subs:
        sub.add_argument("--overwrite", action="store_true", help="replace an existing --out "
                         "file (e.g. a committed results/*.json); without it one is refused")
        sub.set_defaults(func=_refusing_to_replace(sub.get_default("func")))


def _refusing_to_replace(func):
    """``func`` behind the check that ``--out``, when it exists, is replaced only with
    ``--overwrite`` (exit 2 naming both, before anything is measured)."""
    def guarded(args: argparse.Namespace) -> int:
        from hpclb.config.outputs import check_output_file

        if getattr(args, "out", None):
            try:
                check_output_file(args.out, overwrite=args.overwrite)
            except ConfigError as e:
                error(str(e))
                return EXIT_USAGE
        return func(args)
    return guarded


def run(args: argparse.Namespace) -> int:
    """``hpclb bench trust-ratio`` (the other benchmarks run their own drivers); 2 for a bad
    setting."""
    from hpclb.bench import trust_ratio

    setup_logging(0)
    try:
        return trust_ratio.main_args(args)
    except ValueError as e:
        error(str(e))
        return EXIT_USAGE
