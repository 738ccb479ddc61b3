"""report.md: the tables, then a plain conclusion (who wins on each metric and by how much)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..util.words import plural
from .quality import quality_lines
from .repeats import ContenderSummary
from .report_edits import by_kind
from .fleet_view import fleet_lines
from .report_format import fmt, fmt_spread, ms, table as _table
from .report_pace import kept_pace, kept_pace_text, realised_text
from .report_runs import batches, by_steps, refusals
from .report_slo import deadlines_line, own_slo_note
from .results import BenchResults, Knee

# (label, ContenderSummary field, lower is better, kind)
HEADLINE = (
    ("p50 latency", "p50_s", True, "time"),
    ("p95 latency", "p95_s", True, "time"),
    ("p99 latency", "p99_s", True, "time"),
    ("throughput", "throughput_rps", False, "rate"),
    ("goodput", "goodput_rps", False, "rate"),
    ("SLO attainment", "slo_attainment", False, "share"),
)


@dataclass
class Verdict:
    metric: str
    winner: str
    text: str


def _family(results: BenchResults, name: str) -> str:
    for c in results.settings.contenders:
        if c.name == name:
            return c.strategy
    for p in results.settings.peers:  # --peers: a peer's settings are one family (ray, litserve, ...)
        if p["name"] == name:
            return p["peer"]
    return name


def verdicts(results: BenchResults) -> list[Verdict]:
    """For each headline metric: the winner, and its ratio to the best contender of every other strategy."""
    out: list[Verdict] = []
    for label, attr, lower, kind in HEADLINE:
        values = {s.contender: getattr(s, attr).median for s in results.summaries}
        values = {k: v for k, v in values.items() if v is not None}
        if len(values) < 2:
            continue
        pick = min if lower else max
        winner = pick(values, key=values.get)
        if attr == "throughput_rps":
            kept = kept_pace(results, values)
            if winner in kept and len(kept) >= 2:
                out.append(Verdict(label, "", kept_pace_text(results, values, kept)))
                continue
        tied = [n for n in values if n != winner and values[n] == values[winner]]
        best_other: dict[str, str] = {}
        for name, v in values.items():
            if name in tied:  # named with the winner, not again among the others
                continue
            fam = _family(results, name)
            if fam == _family(results, winner):
                continue
            if fam not in best_other or (v < values[best_other[fam]] if lower else v > values[best_other[fam]]):
                best_other[fam] = name
        parts = []
        for name in sorted(best_other.values(), key=values.get, reverse=not lower):
            ratio = values[winner] / values[name] if values[name] else None
            ratio_text = "n/a" if ratio is None else f"{ratio:.2f}x"
            parts.append(f"{name} {fmt(values[name], kind)} (ratio {ratio_text})")
        lead = f"{', '.join([winner] + tied)} tie at" if tied else f"{winner} wins with"
        text = f"**{label}**: {lead} {fmt(values[winner], kind)}"
        text += f"; best of the others: {', '.join(parts)}." if parts else "."
        out.append(Verdict(label, winner, text))
    return out


def knee_text(knees: list[Knee], results: BenchResults) -> list[str]:
    if not knees:
        return []

    def show(k: Knee) -> str:
        if k.rate_rps is None:
            return "below the lowest rate tried"
        text = f"{k.rate_rps:.2f} req/s (realised {k.offered_rps:.2f})"
        return text + (" (held at the highest rate tried: at least this)" if k.held_at_top else "")

    lines = ["**Knee** (highest rate with p95 within the SLO, every request counted): "
             + "; ".join(f"{k.contender} {show(k)}" for k in knees) + "."]
    best = max((k for k in knees if k.rate_rps), key=lambda k: k.rate_rps, default=None)
    if best is not None:
        ratios = []
        top_of_family: dict[str, Knee] = {}
        for k in knees:
            fam = _family(results, k.contender)
            if fam == _family(results, best.contender):
                continue
            if fam not in top_of_family or (k.rate_rps or 0) > (top_of_family[fam].rate_rps or 0):
                top_of_family[fam] = k
        for fam, k in top_of_family.items():
            best_of = f"the best {fam}, " if sum(_family(results, x.contender) == fam for x in knees) > 1 else ""
            ratios.append(f"{best.rate_rps / k.rate_rps:.2f}x the load of {best_of}{k.contender}" if k.rate_rps
                          else f"more than {k.contender} (which held the SLO at no rate tried)")
        if ratios:
            lines.append(f"{best.contender} sustains {'; '.join(ratios)} within the SLO.")
    return lines


def caveats(summaries: list[ContenderSummary]) -> list[str]:
    out = []
    for s in summaries:
        missing = s.offered - s.completed
        if missing > 0:
            missed = f"{s.deadline_missed} missed their deadline, " if s.deadline_missed else ""
            out.append(f"{s.contender}: {missing} of {s.offered} measured requests did not complete ({s.rejected} "
                       f"rejected, {missed}{s.failed} failed, {s.unfinished} still out at the drain limit); its "
                       "latency percentiles cover completed requests only and understate its latency.")
    return out


def deadline_text(results: BenchResults) -> list[str]:
    """With deadlines: who missed how many, how fast refusals were told, and any answer that came back late."""
    if results.settings.timeout_s is None and not results.settings.own_slo_requests:
        return []
    lines = []
    for s in results.summaries:
        told = (f"; refusals told in p50 {ms(s.refusal_p50_ms.median)}, max {ms(s.refusal_max_ms.high)}"
                if s.rejected else "")
        lines.append(f"**Deadlines, {s.contender}**: {s.deadline_missed} of {s.offered} missed their deadline, "
                     f"{s.rejected} refused at arrival{told}.")
    for s in results.summaries:
        if s.late_ok:
            over = max((r.late_ok_max_over_ms for r in results.runs
                        if r.contender == s.contender and r.late_ok_max_over_ms is not None), default=None)
            lines.append(f"**late_ok, {s.contender}: {s.late_ok} request(s) answered OK after their deadline**, "
                         f"the latest {ms(over)} past it (from the send to the answer, on the benchmark's clock); "
                         "an engine that honours deadlines answers none.")
    return lines


def single(results: BenchResults) -> list[str]:
    """With one contender there is nobody to beat: say what it did."""
    if len(results.summaries) != 1:
        return []
    s = results.summaries[0]
    return [f"**{s.contender}**: p50 {fmt(s.p50_s.median, 'time')}, p95 {fmt(s.p95_s.median, 'time')}, "
            f"throughput {fmt(s.throughput_rps.median, 'rate')}, "
            f"SLO attainment {fmt(s.slo_attainment.median, 'share')} "
            f"({s.completed}/{s.offered} completed) under {results.load_description}."]


def conclusions(results: BenchResults) -> list[str]:
    return (single(results) + [v.text for v in verdicts(results)] + knee_text(results.knees, results)
            + deadline_text(results) + caveats(results.summaries))


def render(results: BenchResults) -> str:
    r, st = results, results.settings
    reps = st.repeats
    title = "# stepserve benchmark (simulated)" if r.clock == "simulated" else "# stepserve benchmark"
    lines = [title, "", f"Command: `{r.environment.command}`", ""]
    if st.model is None:
        where = (f"- Target: {st.target} (a running server: its start-up is not measured here); load generated on "
                 f"{r.environment.cpu}, {plural(r.environment.cpu_count, 'core')}")
    else:
        where = (f"- Target: {st.target}; device {st.device} {st.dtype}, backend {st.backend} ({r.environment.cpu}, "
                 f"{plural(r.environment.cpu_count, 'core')}, torch threads {r.environment.torch_threads}); "
                 f"GPU: {r.environment.gpu or 'none'}")
    lines += [where,
              f"- Load: {r.load_description}" + (f"; {realised_text(r)}" if realised_text(r) else "")
              + f"; repeats: {reps}" + (" (contender order rotated each repeat)" if reps > 1 else ""),
              f"- {r.warmup_note}",
              f"- Start-up (not in any number): model load {fmt(r.startup.model_load_s, 'time')}; "
              + (f"measuring the slo latency model {fmt(r.startup.latency_model_s, 'time')}; "
                 if r.startup.latency_model_s is not None else "")
              + f"engine start per run up to {fmt(max(r.startup.engine_start_s, default=None), 'time')}",
              f"- SLO: {st.slo_rule}" + (f" = {fmt(r.slo_s, 'time')}" if r.slo_s else "") + own_slo_note(st),
              "- Deadlines: " + deadlines_line(st)]
    if st.latency_model:
        lines.append(f"- slo latency model: {st.latency_model}")
    if st.peers:
        from .peers.report import peer_lines

        lines += peer_lines(st.peers)
    lags = [run.send_lag.p99 for run in r.runs if run.send_lag.p99 is not None and run.mode == "open-loop"]
    if lags:
        lines.append(f"- Sender accuracy: p99 of (actual - scheduled send) at most {fmt(max(lags), 'time')} over all "
                     "runs; latency counts from the schedule either way")
    lines.append("")
    if r.idle:
        lines += ["## Idle latency (one request alone)", ""]
        lines += _table(["steps", "latency"], [[str(i.steps), fmt(i.latency_s, "time")] for i in r.idle])
    if r.capacity:
        c = r.capacity
        lines += [f"Capacity ({c.contender}, saturated closed loop, {plural(c.users, 'user')}, {c.duration_s:g} s): "
                  f"{c.rps:.2f} req/s.", ""]
    if r.summaries:
        over = " (median over repeats [min-max])" if reps > 1 else ""
        lines += ["## Latency, from scheduled send to answer" + over,
                  ""]
        deadlines = (st.timeout_s is not None or st.own_slo_requests > 0
                     or any(s.deadline_missed or s.late_ok for s in r.summaries))
        extra = ["deadline missed", "late OK"] if deadlines else []
        lines += _table(["contender", "completed/offered", "p50", "p95", "p99", "max", "rejected", "failed",
                         "unfinished"] + extra,
                        [[s.contender, f"{s.completed}/{s.offered}", fmt_spread(s.p50_s, "time", reps),
                          fmt_spread(s.p95_s, "time", reps), fmt_spread(s.p99_s, "time", reps),
                          fmt_spread(s.max_s, "time", reps), str(s.rejected), str(s.failed), str(s.unfinished)]
                         + ([str(s.deadline_missed), str(s.late_ok)] if deadlines else [])
                         for s in r.summaries])
        if deadlines:
            lines += ["Deadline missed: failed with a timeout (the engine gave up at the deadline); failed counts "
                      "every other failure. Late OK: answered OK more than timeout_s after being sent (must be 0).",
                      ""]
        lines += refusals(results)
        lines += ["## Throughput, goodput, utilisation", ""]
        frac = ["goodput / capacity"] if r.capacity else []
        attainment = "SLO attainment (per-request SLOs)" if st.own_slo_requests else "SLO attainment"
        lines += _table(["contender", "throughput", "goodput"] + frac + [attainment, "engine busy",
                                                                         "mean batch", "process CPU"],
                        [[s.contender, fmt_spread(s.throughput_rps, "rate", reps),
                          fmt_spread(s.goodput_rps, "rate", reps)]
                         + ([fmt_spread(s.goodput_frac, "share", reps)] if r.capacity else [])
                         + [fmt_spread(s.slo_attainment, "share", reps),
                            fmt_spread(s.busy_fraction, "share", reps), fmt_spread(s.mean_batch_size, "x", reps),
                            fmt_spread(s.cpu_util, "share", reps)] for s in r.summaries])
        lines += ["## Where the time goes (p50 of completed requests)", ""]
        lines += _table(["contender", "queue", "denoise", "decode"],
                        [[s.contender, fmt_spread(s.queue_p50_s, "time", reps),
                          fmt_spread(s.denoise_p50_s, "time", reps),
                          fmt_spread(s.decode_p50_s, "time", reps)] for s in r.summaries])
        lines += by_steps(results) + by_kind(results) + batches(results)
    if r.sweep:
        lines += ["## Rate sweep", ""]
        lines += ["Rate: the nominal Poisson rate (every contender gets the same trace at it); offered: the rate "
                  "that trace realised in the measured window.", ""]
        lines += _table(["contender", "rate", "offered", "p50", "p95", "p95 (all)", "throughput", "SLO attainment",
                         "held"],
                        [[p.contender, f"{p.rate_rps:.2f}/s", f"{p.offered_rps:.2f}/s", fmt(p.p50_s, "time"),
                          fmt(p.p95_s, "time"),
                          fmt(p.p95_all_s, "time") if p.p95_all_s is not None else "unbounded",
                          fmt(p.throughput_rps, "rate"), fmt(p.slo_attainment, "share"), "yes" if p.held else "no"]
                         for p in r.sweep])
    lines += quality_lines(r.summaries)
    lines += fleet_lines(r.runs)
    lines += ["## Conclusion", ""] + [f"- {c}" for c in r.conclusions] + [""]
    lines += ["## Method", "",
              "- Open-loop load sends each request at its scheduled time whatever the server is doing; latency runs "
              "from the scheduled time. Closed-loop results are labelled as such.",
              "- Every contender replays the identical trace (arrival times and requests, seeded), back to back.",
              "- Percentiles are nearest-rank over completed measured requests; rejected, failed and unfinished "
              "requests are counted and stay in the SLO-attainment denominator. Goodput counts completions "
              "within the SLO per second of the measured window"
              + ("; goodput / capacity divides it by the measured capacity." if r.capacity else "."),
              "- Refusals told in: from a rejected request's actual send to its rejection reply (the sender's own "
              "lag is the send_lag in results.json).",
              "- Engine busy = time inside executor steps / wall time. Process CPU = CPU time / (wall x cores).",
              "- Timings on a shared machine are noisy: compare ratios, and mind the spread.", ""]
    return "\n".join(lines)


def write_report(results: BenchResults, path: Path) -> None:
    path.write_text(render(results))
