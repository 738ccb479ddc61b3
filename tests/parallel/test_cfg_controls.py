"""Which rows a CFG half runs the ControlNets on (controls.sources): its own rows, or, for a family whose
unconditional row takes its conditional row's control outputs (Qwen-Image), the conditional row of each of its
rows, once."""

from stepserve.controls.rows import sources

# a step of 4 requests, of which 1 and 3 are guided: rows 0-3 conditional, 4 and 5 their unconditional rows
N, GUIDED = 4, [1, 3]


def test_one_process_runs_every_row():
    assert sources(N, GUIDED, range(6), False) == (list(range(6)), list(range(6)))


def test_each_half_runs_its_own_rows():
    assert sources(N, GUIDED, range(0, 4), False) == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert sources(N, GUIDED, range(4, 6), False) == ([4, 5], [0, 1])


def test_conditional_rule_runs_each_needed_conditional_row_once():
    assert sources(N, GUIDED, range(6), True) == ([0, 1, 2, 3], [0, 1, 2, 3, 1, 3])  # as one process did
    assert sources(N, GUIDED, range(0, 4), True) == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert sources(N, GUIDED, range(4, 6), True) == ([1, 3], [0, 1])  # the unconditional half: rows 1 and 3 only
    assert sources(N, [], range(0, 0), True) == ([], [])
