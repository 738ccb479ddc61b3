"""The report's lines about per-request SLOs (a trace's slo_ms) and the deadlines they set."""

from __future__ import annotations

from .results import BenchSettings


def own_slo_note(st: BenchSettings) -> str:
    """When trace requests carry their own SLO: say that attainment and goodput are over per-request SLOs."""
    if not st.own_slo_requests:
        return ""
    return (f"; **SLO attainment and goodput are over per-request SLOs**: {st.own_slo_requests} trace requests "
            "carry their own slo_ms and are judged against it, any others against the run's SLO")


def deadlines_line(st: BenchSettings) -> str:
    """Which deadline the requests carried: the run's timeout_s, their own slo_ms, both, or none."""
    own = st.own_slo_requests
    mine = (f"the {own} trace requests with their own slo_ms carry it as their deadline (timeout_s = slo_ms / "
            "1000; a per-request SLO wins over a run-wide deadline)") if own else ""
    if st.timeout_s is None:
        if own:
            return f"{mine}, any others none; a request not done by its deadline fails as a deadline miss"
        return "none (requests carry no timeout_s)"
    who = "every request without its own slo_ms" if own else "every request"
    return (f"{who} carries timeout_s = {st.timeout_s * 1000:.0f} ms ({st.timeout_rule})"
            + (f"; {mine}" if own else "") + "; a request not done by then fails as a deadline miss")
