"""A router's own notes of what it sent: added to a replica's stats until stats taken after the send arrive, or
the request comes back."""

from stepserve.fleet.sent import Sent
from stepserve.fleet.stats import ReplicaStats


def test_what_was_sent_since_the_stats_were_taken_is_added_until_newer_stats_count_it():
    sent, stats = Sent(), ReplicaStats(outstanding=2, work_s=1.0, slack_s=5.0)
    sent.published("a", 10.0)
    sent.sent("a", 1, at=10.5, seconds=0.3)
    sent.sent("a", 2, at=11.0, seconds=0.2)
    sent.sent("b", 3, at=11.0, seconds=9.0)
    seen = sent.adjust("a", stats)
    assert (seen.outstanding, seen.work_s, seen.slack_s) == (4, 1.5, 4.5)
    sent.done("a", 2)  # came back: no longer ahead of anyone
    assert sent.pending("a") == (1, 0.3)
    sent.published("a", 10.8)  # stats taken after request 1 was sent: it is in them now
    assert sent.pending("a") == (0, 0.0) and sent.adjust("a", stats) is stats
    sent.sent("a", 4, at=10.9, seconds=0.1)
    sent.published("a", 10.7)  # older stats arriving late change nothing
    assert sent.pending("a") == (1, 0.1)
    assert sent.pending("b") == (1, 9.0)
    sent.forget("b")
    assert sent.pending("b") == (0, 0.0)
