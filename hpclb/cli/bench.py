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
    """Register ``hpclb bench`` and its benchmarks on the top-level subparsers, each with
    ``--overwrite`` and the check that its ``--out`` is not replaced without it."""
    b = subparsers.add_parser("bench", help=HELP)
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for name, add_arguments, func, help_ in _benchmarks():
        sub = bsub.add_parser(name, help=help_)
        add_arguments(sub)
        sub.add_argument("--overwrite", action="store_true", help="replace an existing --out "
                         "file (e.g. a committed results/*.json); without it one is refused")
        sub.set_defaults(func=_refusing_to_replace(func))
    return b


def _benchmarks() -> list[tuple]:
    """``(command, its arguments, what runs it, help)`` of each benchmark, in help order."""
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
    return [
        ("trust-ratio", trust_ratio.add_arguments, run, "K back-to-back fused LARS/LAMB steps: "
         "kernel time, host overhead, bytes over copy bandwidth, vs the torch path (ResNet-50, "
         "BERT-large shapes)"),
        # bench model|allreduce|scaling (gradient sync)
        ("model", projection.add_arguments, projection.run, "alpha-beta ring allreduce model: "
         "projected step time and scaling efficiency at 1-1024 nodes x 4 GPUs; --simulate: "
         "checked by a SimGrid replay of the sync schedule"),
        ("allreduce", allreduce.add_run_arguments, allreduce.driver, "allreduce bandwidth, "
         "GradientSync, DDP and Horovod step times at 2 and 4 ranks (launches mpirun itself)"),
        ("scaling", scaling.add_run_arguments, scaling.driver, "step time of MNIST-LSTM and "
         "ResNet-50 at 1, 2, 4 ranks, weak and strong (launches mpirun itself)"),
        ("overhead", overhead.add_run_arguments, overhead.driver, "hpclb train against a plain "
         "PyTorch loop (1 process) and DDP over Gloo (2 ranks): paired whole-process runs"),
        ("host-overhead", host_overhead.add_run_arguments, host_overhead.driver, "host time "
         "hpclb adds per step over a plain torch loop: tiny model, 16 and 160 tensors, "
         "SGD/Adam/LARS/LAMB, 1 process and 2 ranks (launches mpirun itself)"),
        # bench logging (per-step logging cost, issue #13)
        ("logging", logging_cost.add_run_arguments, logging_cost.driver, "per-step logging and "
         "noise-scale cost: 2-rank MNIST-LSTM runs with --log-every 50 / 0 / --noise-scale, "
         "alternated"),
        ("loader", loader.add_run_arguments, loader.driver, "images/s per core of the ImageNet "
         "train and eval transforms (DCT-scaled decode, uint8) against the path before, on "
         "synthetic ImageNet-sized JPEGs; writes results/bench_loader.json")]


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
