"""Every result the README quotes is the value recorded in a file under results/.

CLAIMS is the table: a README phrase with « » where the number stands (whitespace in the README
is collapsed to one space before matching; ``…`` stands for one table cell's other text), the
file, a path into its JSON, how the selected values are reduced and how the value is printed.
A README edit or a result file edit that changes what the README would say fails here, naming
the phrase and the file. The README's result passages sit between ``<!-- checked-numbers -->``
and ``<!-- /checked-numbers -->``; every number there must be claimed (a result) or named in
SETTINGS (a setting of the run, not a result), so a figure added without its file fails too.
Nothing is trained here: it reads files.

Path syntax: keys separated by dots; ``[3]`` an index; ``[key=value,...]`` keeps the list's
items whose fields print as the values, and later keys apply to each item kept. A path that
selects several values needs a reduction: mean, min, max, same (all equal), count.
"""
from __future__ import annotations

import copy
import functools
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SLOT = "«»"


@dataclass(frozen=True)
class Claim:
    phrase: str          # README text, SLOT where the number is
    file: str            # relative to the repository
    path: str            # into the file's JSON
    fmt: str = ".2f"     # a format spec, "repr" (Python's float repr, as json prints it) or "s"
    scale: float = 1.0   # e.g. 100 for a fraction printed as a percentage
    reduce: str | None = None


MAIN = "results/front-page/make-train/summary.json"
OWN = "results/front-page/own-model.json"
GPU = "results/gpu/h200-2026-12-04/gpu_check.json"
ADAM = "results/science/mnist-lstm-adam/mnist-lstm.json"
MOM = "results/science/mnist-lstm-momentum/mnist-lstm.json"
CNN = "results/science/fashion-resnet8/fashion-resnet8.json"
PTB = "results/science/ptb-small/ptb-small.json"
PRED = "results/science/predictions.json"
DIAG_CNN = "results/science/diagnostics/cnn-b4096-stable-eta0-s0/summary.json"
PCT = {"scale": 100.0, "fmt": ".2f"}


def _science_row(row: str, file: str, big: int, b0: int, schemes: list[str], **kw) -> list[Claim]:
    """The claims of one row of the README's science table: k, B, then B0 and each scheme's
    mean over seeds (a cell of text, such as 'diverged', is claimed by the row's caller)."""
    prefix, end = f"| {row} | ", " %" if kw.get("scale") == 100.0 else " |"
    out = [Claim(prefix + f"{SLOT} ({big})", file,
                 f"[batch_size={big},scheme=legw,status=done].batch_ratio_k", ".0f", reduce="same"),
           Claim(prefix + f"… ({SLOT}) |", file,
                 f"[batch_size={big},scheme=legw,status=done].batch_size", "d", reduce="same")]
    for i, (batch, scheme) in enumerate([(b0, "legw")] + [(big, s) for s in schemes]):
        out.append(Claim(prefix + "… | " * (i + 1) + SLOT + end, file,
                         f"[batch_size={batch},scheme={scheme},status=done].metric",
                         reduce="mean", **kw))
    return out


def _kmap_claims(workload: str, before: str, after: str, file: str, batch: int, b0_text: str,
                 b0_end: str) -> list[Claim]:
    """One workload's k-map sentence: "<before>K<after>ACC % at B = BATCH <b0_text> B0 <b0_end>":
    the registered k_max (results/science/predictions.json), then LEGW's and B0's means over
    seeds (docs/science.md, "Which batch should I use?")."""
    legw = f"[batch_size={batch},scheme=legw,status=done]"
    return [Claim(f"{before}{SLOT}{after}", PRED, f"workloads.{workload}.k_max", "d"),
            Claim(f"{after}{SLOT} % at B = {batch}", file, legw + ".metric", reduce="mean", **PCT),
            Claim(f"% at B = {SLOT} {b0_text}", file, legw + ".batch_size", "d", reduce="same"),
            Claim(f"{b0_text} {SLOT}{b0_end}", file, "[batch_size=128,scheme=legw,status=done].metric",
                  reduce="mean", **PCT)]


CLAIMS: list[Claim] = [
    # make train's summary line and the main job's bullet
    Claim(f"global batch {SLOT} (k=", MAIN, "global_batch_size", "d"),
    Claim(f"(k={SLOT}) on", MAIN, "batch_ratio_k", ".0f"),
    Claim(f") on {SLOT} rank(s): test_accuracy", MAIN, "world_size", "d"),
    Claim(f"rank(s): test_accuracy {SLOT}% after", MAIN, "final_test_accuracy", **PCT),
    Claim(f"% after {SLOT} epochs (", MAIN, "epochs", ".0f"),
    Claim(f"epochs ({SLOT} steps) in", MAIN, "steps", "d"),
    Claim(f"2 ranks, 2026-12-07): {SLOT} % test accuracy", MAIN, "final_test_accuracy", **PCT),
    # examples/own_model.py
    Claim(f'{{"test_accuracy": {SLOT}, "world_size": 1,', OWN,
          "runs[world_size=1].printed.test_accuracy", "repr", reduce="same"),
    Claim(f'"world_size": 1, "steps": {SLOT}}}', OWN, "runs[world_size=1].printed.steps", "d",
          reduce="same"),
    Claim(f'{{"test_accuracy": {SLOT}, "world_size": 2,', OWN,
          "runs[world_size=2].printed.test_accuracy", "repr", reduce="same"),
    Claim(f'"world_size": 2, "steps": {SLOT}}}', OWN, "runs[world_size=2].printed.steps", "d",
          reduce="same"),
    # what ran on the H200
    Claim(f"gpu_check.sh`: {SLOT} of 14 phases passed", GPU, "phases[status=pass]", "d",
          reduce="count"),
    Claim(f"13 of {SLOT} phases passed", GPU, "phases", "d", reduce="count"),
    Claim(f"phases passed in {SLOT} s", GPU, "seconds", ".0f"),
    Claim(f"MNIST-LSTM at B0 = {SLOT} (", GPU, "phases[phase=mnist_lstm_b0].figures.batch_size",
          "d", reduce="same"),
    Claim(f"MNIST-LSTM at B0 = 128 ({SLOT} %)", GPU,
          "phases[phase=mnist_lstm_b0].figures.final_test_accuracy", reduce="same", **PCT),
    Claim(f"and at k = 64 with LEGW ({SLOT} %)", GPU,
          "phases[phase=mnist_lstm_large].figures.final_test_accuracy", reduce="same", **PCT),
    Claim(f"bf16 step of {SLOT} images", GPU, "phases[phase=resnet50_step].figures.batch_per_gpu",
          "d", reduce="same"),
    Claim(f"images in {SLOT} s,", GPU, "phases[phase=resnet50_step].figures.bf16.step_s", ".3f",
          reduce="same"),
    Claim(f"NCCL at world size {SLOT},", GPU, "phases[phase=nccl].figures.world_size", "d",
          reduce="same"),
    Claim(f"kernel at {SLOT}–92 % of copy bandwidth", GPU,
          "aims.trust_ratio_kernel.checks[field=fraction_of_copy_bandwidth].value", ".0f", 100.0,
          "min"),
    Claim(f"kernel at 76–{SLOT} % of copy bandwidth", GPU,
          "aims.trust_ratio_kernel.checks[field=fraction_of_copy_bandwidth].value", ".0f", 100.0,
          "max"),
    Claim(f"and {SLOT}–34× the `_foreach` path on ResNet-50", GPU,
          "aims.trust_ratio_kernel.checks[set=resnet50,field=speedup_vs_torch].value", ".0f",
          reduce="min"),
    Claim(f"and 33–{SLOT}× the `_foreach` path on ResNet-50", GPU,
          "aims.trust_ratio_kernel.checks[set=resnet50,field=speedup_vs_torch].value", ".0f",
          reduce="max"),
    Claim(f"with LEGW {SLOT} % against B0's", GPU,
          "phases[phase=mnist_lstm_large].figures.final_test_accuracy", reduce="same", **PCT),
    Claim(f"against B0's {SLOT} % (one seed)", GPU,
          "phases[phase=mnist_lstm_b0].figures.final_test_accuracy", reduce="same", **PCT),
    # the paper's claim (docs/science.md): means over seeds
    *_science_row("MNIST-LSTM, Adam", ADAM, 8192, 128, ["legw", "sqrt", "goyal", "none"], **PCT),
    *_science_row("MNIST-LSTM, SGD + momentum", MOM, 8192, 128, ["legw", "sqrt", "goyal", "none"],
                  **PCT),
    *_science_row("Fashion-MNIST ResNet-8, LARS", CNN, 4096, 128, ["legw", "sqrt"], **PCT),
    Claim(f"| Fashion-MNIST ResNet-8, LARS | … | … | … | … | {SLOT} |", CNN,
          "[batch_size=4096,scheme=goyal].status", "s", reduce="same"),
    *_science_row("PTB-small, test perplexity", PTB, 640, 20, ["legw", "sqrt", "goyal", "none"],
                  fmt=".1f"),
    Claim(f"At k = {SLOT} (B = 1024) LEGW holds", ADAM,
          "[batch_size=1024,scheme=legw,status=done].batch_ratio_k", ".0f", reduce="same"),
    Claim(f"At k = 8 (B = {SLOT}) LEGW holds", ADAM,
          "[batch_size=1024,scheme=legw,status=done].batch_size", "d", reduce="same"),
    Claim(f"LEGW holds with Adam ({SLOT} %)", ADAM,
          "[batch_size=1024,scheme=legw,status=done].metric", reduce="mean", **PCT),
    Claim(f"just misses with momentum ({SLOT} %)", MOM,
          "[batch_size=1024,scheme=legw,status=done].metric", reduce="mean", **PCT),
    # the k-map (docs/science.md, "Which batch should I use?"): predictions, then means over seeds
    *_kmap_claims("mnist-adam", "MNIST-LSTM with Adam, predicted k_max ", ", measured 32 (", ADAM,
                  4096, "against B0's", " %); with SGD"),
    *_kmap_claims("mnist-momentum", "with SGD + momentum, predicted ", ", measured below 8 (",
                  MOM, 2048, "against its B0's", " %): √k"),
    Claim(f"Fashion ResNet-8 with LARS, predicted {SLOT} (the recipe's", PRED,
          "workloads.cnn.k_max", "d"),
    Claim(f"measured 4 ({SLOT} % at B = 512", CNN,
          "[batch_size=512,scheme=legw,status=done].metric", reduce="mean", **PCT),
    Claim(f"measured 4 (… % at B = {SLOT} against", CNN,
          "[batch_size=512,scheme=legw,status=done].batch_size", "d", reduce="same"),
    Claim(f"at B = 512 against {SLOT} %): a short", CNN,
          "[batch_size=128,scheme=legw,status=done].metric", reduce="mean", **PCT),
    Claim(f"at k = 8 it fails ({SLOT} % over seeds 0-2", CNN,
          "[batch_size=1024,scheme=legw,status=done].metric", reduce="mean", **PCT),
    Claim(f"reaches {SLOT} % at k = 32, where LEGW", DIAG_CNN, "final_test_accuracy", **PCT),
    Claim(f"at k = 32, where LEGW reached {SLOT} %. PTB", CNN,
          "[batch_size=4096,scheme=legw,status=done].metric", reduce="mean", **PCT),
    Claim(f"PTB-small, predicted k_max {SLOT} (bound", PRED, "workloads.ptb.k_max", "d"),
    Claim(f"k = 4 holds ({SLOT} over seeds 0-2 against", PTB,
          "[batch_size=80,scheme=legw,status=done].metric", reduce="mean"),
    Claim(f"over seeds 0-2 against B0's {SLOT}, within its", PTB,
          "[batch_size=20,scheme=legw,status=done].metric", ".1f", reduce="mean"),
    Claim(f"k = 8 reaches {SLOT}: under-trained", PTB,
          "[batch_size=160,scheme=legw,seed=0,status=done].metric", reduce="same"),
    Claim(f"at k = 16, its peak at that B0 LR, {SLOT}.", PTB,
          "[batch_size=320,scheme=legw,seed=0,status=done].metric", reduce="same"),
    # benchmarks
    Claim(f"2 ranks, `results/bench_allreduce_mean.json`): {SLOT}× a raw mpi4py Allreduce",
          "results/bench_allreduce_mean.json", "hpclb_vs_raw_mean_allreduce"),
    Claim(f"followed by the division, {SLOT} of the raw sum's best round",
          "results/bench_allreduce_mean.json", "hpclb_vs_raw_allreduce"),
    Claim(f"takes {SLOT}× a plain PyTorch loop at 1 process", "results/bench_overhead.json",
          "results.mnist-lstm/1proc.ratio_of_medians", ".3f"),
    Claim(f"and {SLOT}× DDP (Gloo) at 2 ranks", "results/bench_overhead.json",
          "results.mnist-lstm/2ranks.ratio_of_medians", ".3f"),
    Claim(f"BLEU {SLOT} — a working pipeline", "results/gnmt-cpu/summary.json",
          "final_test_bleu"),
    Claim(f"`results/bench_loader.json`): {SLOT} images/s per core", "results/bench_loader.json",
          "images_per_s_per_core.train.fast_shards_restarts", ".0f"),
    Claim(f"(target {SLOT} not met on this machine)", "results/bench_loader.json",
          "target_images_per_s_per_core", ".0f"),
]

# Numbers in the checked passages that are settings of a run or a target, not results.
SETTINGS = [
    "mpirun -n 2", '"world_size": 1', '"world_size": 2', "at k = 64 with LEGW", "B = 1024 = 8·B0",
    "2 ranks, 2026-12-07", "3 seeds", "ResNet-50's gradients, 2 ranks", "(target 0.95 not met)",
    "at 1 process", "at 2 ranks", "k = 16 and 32", "measured 32 (", "measured below 8",
    "√k under-scales", "measured 4 (", "protocol's k = 8, 32, 64 results",
    "within a factor 2", "4, 8 and 16 on the CNN and PTB", "over seeds 0-2",
    "within its 3 % tolerance", "at k = 8", "k = 8 reaches", "at k = 32, where", "at k = 16, its peak", "measured 4: k = 4 holds",
]


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _pattern(phrase: str) -> re.Pattern:
    head, sep, tail = phrase.partition(SLOT)
    assert sep and SLOT not in tail, f"a claim needs one {SLOT}: {phrase!r}"
    lit = [re.escape(part).replace(re.escape("…"), r"[^|]*?") for part in (head, tail)]
    return re.compile(lit[0] + r"([^\s|]+)" + lit[1])


def _select(node, path: str):
    """The values at `path` (see the module docstring) and, for a count, the items counted."""
    nodes, many = [node], False
    for part in re.findall(r"\[[^\]]*\]|[^.\[\]]+", path):
        if part.startswith("[") and "=" in part:
            want = dict(kv.split("=", 1) for kv in part[1:-1].split(","))
            nodes = [item for n in nodes for item in n
                     if all(_printed(item.get(k)) == v for k, v in want.items())]
            many = True
        elif part.startswith("["):
            nodes = [n[int(part[1:-1])] for n in nodes]
        else:
            nodes = [n[part] for n in nodes]
    return nodes if many else nodes[0]


def _printed(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _value(claim: Claim, data):
    got = _select(data, claim.path)
    if claim.reduce is None:
        return got
    if claim.reduce == "count":
        return len(got)
    assert got, f"{claim.path} selects nothing in {claim.file}"
    if claim.reduce == "same":
        assert all(g == got[0] for g in got), f"{claim.path} differs between items: {got}"
        return got[0]
    return {"mean": statistics.fmean, "min": min, "max": max}[claim.reduce](got)


def _format(claim: Claim, value) -> str:
    if claim.fmt == "repr":
        return json.dumps(value)
    if claim.fmt == "s":
        return str(value)
    if claim.fmt == "d":
        assert float(value).is_integer(), f"{claim.path} is not a whole number: {value}"
        return str(int(value))
    return format(value * claim.scale, claim.fmt)


@functools.lru_cache(maxsize=None)
def _load(file: str):
    """The file's JSON, read once (callers copy it before changing it)."""
    return json.loads((REPO / file).read_text())


def check(readme: str, load=_load) -> tuple[list[str], list[tuple[int, int]]]:
    """The claims that do not hold (phrase, file, README value, file value) and the spans of
    the README's claimed numbers."""
    text, errors, spans = _normalise(readme), [], []
    for claim in CLAIMS:
        found = list(_pattern(claim.phrase).finditer(text))
        if len(found) != 1:
            errors.append(f"README phrase {claim.phrase!r} found {len(found)} times (want once); "
                          f"its number is checked against {claim.file}")
            continue
        shown = found[0].group(1)
        spans.append(found[0].span(1))
        try:
            want = _format(claim, _value(claim, load(claim.file)))
        except (AssertionError, KeyError, IndexError, TypeError, ValueError, OSError) as exc:
            errors.append(f"README phrase {claim.phrase!r}: {claim.file} ({claim.path}) cannot "
                          f"give its value: {type(exc).__name__}: {exc}")
            continue
        if shown != want:
            errors.append(f"README phrase {claim.phrase!r} says {shown}, {claim.file} "
                          f"({claim.path}, {claim.reduce or 'value'}) gives {want}")
    return errors, spans


def test_readme_numbers_are_the_recorded_results():
    errors, _ = check(README.read_text())
    assert not errors, "the README and results/ disagree:\n" + "\n".join(errors)


def test_every_number_in_the_checked_passages_is_claimed():
    """A number between the checked-numbers markers is a claim's or a named setting's."""
    text = _normalise(README.read_text())
    _, spans = check(README.read_text())
    regions = re.findall(r"<!-- checked-numbers -->(.*?)<!-- /checked-numbers -->", text)
    assert len(regions) >= 4, "the README lost its checked-numbers markers"
    covered = list(spans)
    for phrase in SETTINGS:
        hits = [m.span() for m in re.finditer(re.escape(phrase), text)]
        assert hits, f"SETTINGS names {phrase!r}, which the README no longer has"
        covered += hits
    unclaimed = []
    for m in re.finditer(r"<!-- checked-numbers -->.*?<!-- /checked-numbers -->", text):
        for num in re.finditer(r"(?<![\w.\-/#])\d+(?:,\d{3})*(?:\.\d+)?(?![\w\-/])", m.group(0)):
            lo, hi = m.start() + num.start(), m.start() + num.end()
            if not any(a <= lo and hi <= b for a, b in covered):
                unclaimed.append(text[max(0, lo - 40):hi + 20])
    assert not unclaimed, ("numbers in the README's checked passages with no claim in "
                           "tests/test_readme_numbers.py (add one, with its file):\n"
                           + "\n".join(unclaimed))


def test_claimed_files_exist_and_hold_no_machine_paths():
    for file in sorted({c.file for c in CLAIMS}):
        assert (REPO / file).is_file(), f"{file} (a README claim's source) is missing"
    for record in sorted((REPO / "results" / "front-page").rglob("*.json")):
        assert "/work/" not in record.read_text(), f"{record} names this machine's directories"


def _bump(value):
    if isinstance(value, bool) or value is None:
        return "changed"
    if isinstance(value, (int, float)):
        return value * 1.5 + 1
    return f"{value}-changed"


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.phrase[:40])
def test_a_changed_side_is_caught(claim):
    """Changing the README's number or the file's values makes check() name this claim."""
    readme = README.read_text()
    errors, _ = check(readme)
    assert not any(repr(claim.phrase) in e for e in errors)
    # the README side: another number where the claim's stands
    m = _pattern(claim.phrase).search(_normalise(readme))
    edited = _normalise(readme)[:m.start(1)] + "7" + m.group(1) + _normalise(readme)[m.end(1):]
    assert any(repr(claim.phrase) in e for e in check(edited)[0])

    # the file side: every value the path selects changed (a count: one item fewer)
    def load(file):
        data = _load(file)
        if file != claim.file:
            return data
        data = copy.deepcopy(data)
        parent_path, _, leaf = claim.path.rpartition(".")
        if claim.reduce == "count":
            _remove_one(data, _select(data, claim.path)[0])
            return data
        parents = _select(data, parent_path) if parent_path else data
        for parent in (parents if isinstance(parents, list) else [parents]):
            parent[leaf] = _bump(parent[leaf])
        return data
    assert any(repr(claim.phrase) in e for e in check(readme, load)[0])


def _remove_one(node, item) -> bool:
    """Remove `item` (by identity) from the list that holds it, anywhere under `node`."""
    children = node if isinstance(node, list) else list(node.values()) if isinstance(node, dict) \
        else []
    if isinstance(node, list) and any(c is item for c in node):
        node.remove(item)
        return True
    return any(_remove_one(c, item) for c in children if isinstance(c, (list, dict)))
