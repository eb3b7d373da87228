"""What ``hpclb sweep`` writes for a sweep's rows (:mod:`hpclb.tools.sweep`): the markdown
tables, the PNG (metric against batch size per scheme with B0 marked, and the LR curve of every
point, one panel per scheme) and the JSON, each written atomically."""
from __future__ import annotations

import json
from pathlib import Path

from hpclb._io import write_text_atomic
from hpclb.schedules import SCHEMES, Schedule
from hpclb.tools.figures import pyplot, save
from hpclb.tools.verdict import verdict_markdown

__all__ = ["BUDGET_KEYS", "budgets", "budget_label", "format_metric", "markdown_table", "lr_curve",
           "plot", "verdict_sections", "write_results"]


def format_metric(metric: str, value: float | None) -> str:
    """``value`` of ``metric`` for a table: accuracies in %, "—" for None."""
    if value is None:
        return "—"
    if "accuracy" in metric:
        return f"{100 * value:.2f}%"
    if value >= 1e5:
        return f"{value:.2e}"
    return f"{value:.2f}" if value >= 10 else f"{value:.4f}"


# What makes points comparable in one table: the same budget and set-up.
BUDGET_KEYS = ("epochs", "ranks", "seed", "optimizer")


def budgets(rows: list[dict]) -> list[tuple]:
    """The distinct ``(epochs, ranks, seed, optimizer)`` of ``rows``, in first-seen order."""
    return list(dict.fromkeys(tuple(r.get(k) for k in BUDGET_KEYS) for r in rows))


def budget_label(budget: tuple) -> str:
    """``"2 epochs, 1 rank(s), seed 0, adam"``."""
    epochs, ranks, seed, opt = budget
    e = "? epochs" if epochs is None else f"{epochs:g} epochs"
    return f"{e}, {ranks} rank(s), seed {seed}, {opt}"


def markdown_table(rows: list[dict], name: str, metric: str, mode: str) -> str:
    """The sweep as markdown, one section per budget (:data:`BUDGET_KEYS`: points trained for
    different epochs, ranks, seeds or optimizers never share a table): final ``metric`` per
    batch size (rows) and scheme (columns), the gap to the smallest batch of the same scheme,
    and every point's schedule and cost."""
    groups = budgets(rows)
    if len(groups) <= 1:
        return _budget_table(rows, name, metric, mode)
    parts = [f"# Sweep: {name}", "", f"{len(groups)} budgets, one table each.", ""]
    for g in groups:
        sub = [r for r in rows if tuple(r.get(k) for k in BUDGET_KEYS) == g]
        text = _budget_table(sub, name, metric, mode)
        parts.append(text.replace(f"# Sweep: {name}", f"## {budget_label(g)}", 1))
    return "\n".join(parts)


def _budget_table(rows: list[dict], name: str, metric: str, mode: str) -> str:
    """:func:`markdown_table` of rows of one budget."""
    schemes = [s for s in SCHEMES if any(r["scheme"] == s for r in rows)]
    batches = sorted({r["batch_size"] for r in rows})
    by = {(r["batch_size"], r["scheme"]): r for r in rows}
    base = min(batches) if batches else None
    lines = [f"# Sweep: {name}", "",
             f"Final {metric} ({'higher' if mode == 'max' else 'lower'} is better); in brackets "
             f"the difference to the smallest batch ({base}) under the same scheme "
             f"({'percentage points' if 'accuracy' in metric else 'as a ratio'}). — = not run or "
             f"rejected (see the detail table).", "",
             "| batch | " + " | ".join(schemes) + " |", "|---:|" + "---:|" * len(schemes)]
    for b in batches:
        cells = []
        for s in schemes:
            r = by.get((b, s))
            if r is None or r.get("metric") is None:
                cells.append("—")
                continue
            ref = by.get((base, s))
            txt = format_metric(metric, r["metric"])
            if b != base and ref and ref.get("metric") is not None:
                d = r["metric"] - ref["metric"]
                txt += f" ({100 * d:+.2f})" if "accuracy" in metric else \
                    f" (x{r['metric'] / ref['metric']:.3g})" if ref["metric"] else f" ({d:+.3g})"
            cells.append(txt)
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines += ["", "| batch | scheme | k | peak LR | warmup steps (epochs) | steps | epochs | "
              f"{metric} | best | wall time (s) | time to target (s) | ranks | note |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["batch_size"], list(SCHEMES).index(r["scheme"]))):
        if r.get("error"):
            why = r["error"] if r.get("status") != "diverged" else \
                f"diverged at step {r.get('diverged_at_step')}: {r['error']}"
            lines.append(f"| {r['batch_size']} | {r['scheme']} | {_schedule_cells(r)} | | "
                         f"{r['epochs']:g} | — | | | | {r['ranks']} | {why.replace('|', '/')} |")
            continue
        ttt = r.get("time_to_target_s")
        lines.append(
            f"| {r['batch_size']} | {r['scheme']} | {_schedule_cells(r)} | {r['steps']} | "
            f"{r['epochs']:g} | "
            f"{format_metric(metric, r['metric'])} | "
            f"{format_metric(metric, r.get('best_metric'))} | "
            f"{r['wall_time_s']:.0f} | {'—' if ttt is None else f'{ttt:.0f}'} | {r['ranks']} | "
            f"{r.get('note') or ''} |")
    return "\n".join(lines) + "\n"


def _schedule_cells(row: dict) -> str:
    """``k | peak LR | warmup steps (epochs)`` of a row (empty cells where the schedule is
    unknown: a point rejected before it had one)."""
    if row.get("peak_lr") is None:
        return " | | "
    return (f"{row['batch_ratio_k']:g} | {row['peak_lr']:.4g} | "
            f"{row['warmup_steps']} ({row['warmup_epochs']:.3g})")


def lr_curve(row: dict, points: int = 400) -> tuple[list[float], list[float]]:
    """(epochs, LR) of a recorded point, rebuilt from its schedule (a pure function of the step)."""
    decay = dict(row["decay"])
    sched = Schedule(peak_lr=row["peak_lr"], warmup_steps=row["warmup_steps"],
                     total_steps=row["steps"], steps_per_epoch=row["steps_per_epoch"],
                     decay=decay.pop("name"), decay_params=decay,
                     warmup_start_lr=row.get("warmup_start_lr", 0.0))
    stride = max(1, row["steps"] // points)
    steps = list(range(0, row["steps"], stride)) + [row["steps"] - 1]
    return [s / row["steps_per_epoch"] for s in steps], [sched.lr(s) for s in steps]


def plot(rows: list[dict], path: Path, name: str, metric: str):
    """PNG: the metric vs batch size (log2) per scheme with B0 marked, then one LR-vs-epoch
    panel per scheme. Returns the (closed) figure."""
    plt = pyplot("the sweep plot")
    schemes = [s for s in SCHEMES if any(r["scheme"] == s for r in rows)]
    fig, axes = plt.subplots(1, 1 + len(schemes), figsize=(4.2 * (1 + len(schemes)), 3.6),
                             squeeze=False)
    ax = axes[0][0]
    scale = 100.0 if "accuracy" in metric else 1.0
    groups = budgets(rows)
    for s in schemes:
        for g in groups:  # one line per scheme and budget: budgets are never joined
            pts = sorted((r["batch_size"], r["metric"]) for r in rows
                         if r["scheme"] == s and r.get("metric") is not None
                         and tuple(r.get(k) for k in BUDGET_KEYS) == g)
            if pts:
                ax.plot([p[0] for p in pts], [scale * p[1] for p in pts], marker="o",
                        label=s if len(groups) == 1 else f"{s}, {budget_label(g)}")
    for b0 in sorted({round(r["batch_size"] / r["batch_ratio_k"]) for r in rows
                      if r.get("batch_ratio_k")}):  # the batch the recipe was tuned at
        ax.axvline(b0, color="gray", ls=":", lw=1.2, label=f"B0 = {b0}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch size")
    ax.set_ylabel(metric + (" (%)" if scale == 100.0 else ""))
    ax.set_title(f"{name}: final {metric}")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend()
    for ax, s in zip(axes[0][1:], schemes):
        for r in sorted((r for r in rows if r["scheme"] == s and not r.get("error")),
                        key=lambda r: (r["batch_size"], str(r.get("epochs")))):
            x, y = lr_curve(r)
            ax.plot(x, y, label=f"B={r['batch_size']}" + ("" if len(groups) == 1 else
                                                           f", {r.get('epochs'):g} ep"))
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_ylabel("learning rate")
        ax.set_title(f"LR schedule: {s}")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)
    return fig


def verdict_sections(rows: list[dict], metric: str, mode: str, base_batch: int) -> str:
    """One :func:`~hpclb.tools.verdict.verdict_markdown` section per set-up (epochs, ranks,
    optimizer), over its seeds."""
    setups = list(dict.fromkeys((r.get("epochs"), r.get("ranks"), r.get("optimizer"))
                                for r in rows))
    parts = []
    for e, n, opt in setups:
        sub = [r for r in rows if (r.get("epochs"), r.get("ranks"), r.get("optimizer")) ==
               (e, n, opt)]
        text = verdict_markdown(sub, metric=metric, mode=mode, base_batch=base_batch)
        parts.append(text.replace("## ", f"## {opt}, {e:g} epochs, {n} rank(s): ", 1)
                     if len(setups) > 1 else text)
    return "\n".join(parts)


def write_results(rows: list[dict], out_dir: Path, name: str, metric: str, mode: str,
                  base_batch: int) -> None:
    """Write ``<name>.json``, ``.md`` and ``.png`` under ``out_dir`` (each atomically); the
    markdown ends with the seeds' means and the verdict at B0 ``base_batch`` (samples;
    :func:`verdict_sections`)."""
    md = markdown_table(rows, name, metric, mode)
    if rows:
        md += "\n" + verdict_sections(rows, metric, mode, base_batch)
    for suffix, text in ((".json", json.dumps(rows, indent=2) + "\n"), (".md", md)):
        write_text_atomic(out_dir / f"{name}{suffix}", text)
    if rows:
        plot(rows, out_dir / f"{name}.png", name, metric)
