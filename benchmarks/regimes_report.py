"""The regime matrix's numbers: each cell's metrics from a bench result, the table of every row, and the verdict
per cell by the acceptance test of the cost-regimes work (the default within 5% of the best contender on p95 and
attainment and 10% on p50; and whether it is >= 10% better than every fixed alternative). Used by
benchmarks/regimes.py and regimes_seeds.py."""

from __future__ import annotations

import math
import statistics

from stepserve.bench.metrics import percentile
from stepserve.bench.targets import OK, REJECTED, TIMEOUT

DEADLINE_X = 3.0  # deadline cells: each request's deadline is this many times its own standalone latency


def step_rate(result) -> float:
    """Denoising steps of the requests completed inside the measured window, per second."""
    lo, hi = result.window_start_s, result.window_end_s
    done = [o for o in result.outcomes if o.status == OK and o.done_s is not None and lo <= o.done_s <= hi]
    return sum(o.spec.num_inference_steps for o in done) / (hi - lo) if hi > lo else 0.0


def cell_metrics(result, standalone: dict[int, float]) -> dict:
    measured = result.measured
    done = [o for o in measured if o.latency_s is not None]
    lat = [o.latency_s for o in done]
    slow = [o.latency_s / standalone[o.spec.num_inference_steps] for o in done]
    good = [o for o in done if o.latency_s <= DEADLINE_X * standalone[o.spec.num_inference_steps]]
    lo, hi = result.window_start_s, result.window_end_s
    in_window = sum(1 for o in good if lo <= o.done_s <= hi)
    return {"p50_s": percentile(lat, 50) if lat else None, "p95_s": percentile(lat, 95) if lat else None,
            "p99_s": percentile(lat, 99) if lat else None,
            "slowdown_p95": percentile(slow, 95) if slow else None,
            "attainment": len(good) / len(measured) if measured else None,
            "goodput_rps": in_window / (hi - lo) if hi > lo else None,
            "done": len(done) / len(measured) if measured else None, "measured": len(measured),
            # why the others did not complete: refused at admission (429 or deadline infeasible), or ended by a
            # timeout (given up as hopeless, or past their deadline)
            "refused": share(measured, REJECTED), "timed_out": share(measured, TIMEOUT),
            "batch_seen": batch_seen(done),
            # where the completed requests' time went (means, seconds): waiting for a slot, arrival to the first
            # step done, the denoising steps (paused steps included), the decode
            **{f"{stage}_mean_s": mean_of(done, f"{stage}_s") for stage in ("queue", "first_step", "denoise", "decode")}}


def mean_of(outcomes, field: str) -> float | None:
    values = [getattr(o.reply, field) for o in outcomes if getattr(o.reply, field) is not None]
    return sum(values) / len(values) if values else None


def batch_seen(outcomes) -> float | None:
    """The mean size of the forwards the requests' steps ran in (each step of each request counted once)."""
    sizes = [b for o in outcomes for b in o.reply.batch_sizes]
    return sum(sizes) / len(sizes) if sizes else None


def share(outcomes, status: str) -> float | None:
    return sum(1 for o in outcomes if o.status == status) / len(outcomes) if outcomes else None


def median_metrics(runs: list[dict]) -> dict:
    """Each metric's median over the repeats (None where a repeat has none), with every repeat's values."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    out["repeats"] = runs
    return out



def fmt(v, kind: str) -> str:
    if v is None or (isinstance(v, float) and math.isinf(v)):
        return "-"
    return {"s": f"{v:.2f}", "x": f"{v:.2f}x", "%": f"{100 * v:.0f}%", "r": f"{v:.3g}"}[kind]


def table(rows: list[dict]) -> str:
    head = ("| regime | load | deadline | contender | p50 s | p95 s | p99 s | p95 slowdown | attainment | goodput/s "
            "| done | refused, timed out |")
    out = [head, "|" + "---|" * 12]
    for r in rows:
        out.append(f"| {r['regime']} | {r['load']:g} | {r['deadline']} | {r['contender']} | {fmt(r['p50_s'], 's')} "
                   f"| {fmt(r['p95_s'], 's')} | {fmt(r['p99_s'], 's')} | {fmt(r['slowdown_p95'], 'x')} "
                   f"| {fmt(r['attainment'], '%')} | {fmt(r['goodput_rps'], 'r')} | {fmt(r['done'], '%')} "
                   f"| {fmt(r.get('refused'), '%')}, {fmt(r.get('timed_out'), '%')} |")
    return "\n".join(out)


FIXED = ("none", "static", "dynamic(10ms)", "dynamic(50ms)", "continuous")  # the fixed alternatives of issue's test


def cells_of(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The rows of each (regime, load, deadline) cell, control copies (controls()) left out."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if "#" not in r["contender"]:
            cells.setdefault((r["regime"], r["load"], r["deadline"]), []).append(r)
    return cells


def comparable(rs: list[dict]) -> list[dict]:
    """The rows of a cell whose p50 and p95 compare: those that completed as many requests (within 1 point)."""
    top = max(r["done"] or 0 for r in rs)
    return [r for r in rs if r["p95_s"] is not None and (r["done"] or 0) >= top - 0.01]


def within_margins(r: dict, rs: list[dict]) -> bool:
    """Whether row `r` is within the issue's margins of the best of its cell `rs`: 5% on p95 and attainment, 10% on
    p50 (p50 and p95 among the comparable rows; a row that completed fewer is not within)."""
    ok = comparable(rs)
    if r not in ok:
        return False
    b50, b95 = min(r_["p50_s"] for r_ in ok), min(r_["p95_s"] for r_ in ok)
    best_att = max(r_["attainment"] or 0 for r_ in rs)
    return r["p95_s"] <= 1.05 * b95 and r["p50_s"] <= 1.10 * b50 and (r["attainment"] or 0) >= 0.95 * best_att


def verdict(rows: list[dict]) -> tuple[str, int, int, int]:
    """Per cell, the default against the best contender (within_margins), and whether it beats each fixed
    alternative by at least 10% on p95 (lower) or on attainment (higher; the fixed alternative's p95 read as it
    is, whatever it completed). Returns the table, the cells within margins, the cells strictly better, and the
    cells."""
    out = ["| regime | load | deadline | p50 / best (best) | p95 / best (best) | attainment, best (best) | within "
           "| >=10% better than every fixed |", "|" + "---|" * 8]
    cells = cells_of(rows)
    within = better = 0
    for key, rs in cells.items():
        d = next((r for r in rs if r["contender"].startswith("default")), None)
        ok = comparable(rs)
        if d is None or d not in ok:
            out.append(f"| {key[0]} | {key[1]:g} | {key[2]} | - | - | - | no (completed fewer) | - |")
            continue
        b50, b95 = min(ok, key=lambda r: r["p50_s"]), min(ok, key=lambda r: r["p95_s"])
        ba = max(rs, key=lambda r: r["attainment"] or 0)
        att, best_att = d["attainment"] or 0, ba["attainment"] or 0
        good = within_margins(d, rs)
        fixed = [r for r in rs if r["contender"] in FIXED and r is not d]
        wins = bool(fixed) and all((r["p95_s"] is None or d["p95_s"] <= 0.9 * r["p95_s"])
                                   or att >= 1.1 * (r["attainment"] or 0) for r in fixed)
        within, better = within + good, better + wins
        out.append(f"| {key[0]} | {key[1]:g} | {key[2]} | {d['p50_s'] / b50['p50_s']:.2f}x ({b50['contender']}) "
                   f"| {d['p95_s'] / b95['p95_s']:.2f}x ({b95['contender']}) "
                   f"| {fmt(att, '%')}, {fmt(best_att, '%')} ({ba['contender']}) | {'yes' if good else 'no'} "
                   f"| {'yes' if wins else 'no'} |")
    return "\n".join(out), within, better, len(cells)


def standings(rows: list[dict]) -> dict[str, int]:
    """For every contender, the cells in which it is within the margins of the best (within_margins): the
    question a default answers is which one strategy is never far from the best, whatever the regime."""
    counts: dict[str, int] = {}
    for rs in cells_of(rows).values():
        for r in rs:
            counts[r["contender"]] = counts.get(r["contender"], 0) + within_margins(r, rs)
    return counts


def controls(rows: list[dict]) -> str:
    """Per cell, each control copy ('none#2') against its original ('none'): the ratio of their p50, p95 and
    attainment. Two runs of one strategy on one trace differ only by the machine (the noise of a live run);
    a gap between strategies no larger than this is not resolved by the run. '' without controls."""
    out = []
    for r in rows:
        name, hash_, _ = r["contender"].partition("#")
        if not hash_:
            continue
        orig = next((o for o in rows if o["contender"] == name and (o["regime"], o["load"], o["deadline"])
                     == (r["regime"], r["load"], r["deadline"])), None)
        if orig is None:
            continue
        ratio = [f"{a / b:.2f}x" if a is not None and b else "-"
                 for a, b in ((r["p50_s"], orig["p50_s"]), (r["p95_s"], orig["p95_s"]))]
        out.append(f"| {r['regime']} | {r['load']:g} | {r['deadline']} | {r['contender']} / {name} | {ratio[0]} "
                   f"| {ratio[1]} | {fmt(r['attainment'], '%')}, {fmt(orig['attainment'], '%')} |")
    if not out:
        return ""
    return "\n".join(["| regime | load | deadline | control | p50 ratio | p95 ratio | attainment (copy, original) |",
                      "|" + "---|" * 7] + out)
