"""Progress output: a live bar on a terminal, a line per phase in logs."""

from __future__ import annotations

import io

from stepserve.util.progress import LineProgress, progress
from stepserve.util.words import plural


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_non_terminal_stream_gets_one_line_per_phase():
    out = io.StringIO()
    with progress(1000, "generate", "image", file=out) as bar:
        for _ in range(1000):
            bar.update(1)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "generate: started (1000 images)"
    assert lines[1].startswith("generate: done 1000 images in ") and lines[1].endswith(" s")


def test_unknown_total_postfix_and_an_early_stop_are_reported():
    out = io.StringIO()
    bar = progress(None, "capacity", "request", file=out)
    bar.update(7)
    bar.set_postfix(loss="0.1234")
    bar.close()
    bar.close()  # closing twice writes nothing more
    lines = out.getvalue().splitlines()
    assert lines[0] == "capacity: started" and lines[1].startswith("capacity: done 7 requests in ")
    assert lines[1].endswith("(loss=0.1234)") and len(lines) == 2

    out = io.StringIO()
    with progress(10, "sweep", "contender", file=out) as bar:
        bar.update(3)
    assert "sweep: stopped at 3/10 contenders after " in out.getvalue()


def test_counts_read_in_words_one_and_many():
    out = io.StringIO()
    with progress(1, "export", "graph", file=out) as bar:
        bar.update(1)
    with progress(6, "export", "graph", file=out) as bar:
        bar.update(6)
    lines = out.getvalue().splitlines()
    assert lines[0] == "export: started (1 graph)" and lines[1].startswith("export: done 1 graph in ")
    assert lines[2] == "export: started (6 graphs)" and lines[3].startswith("export: done 6 graphs in ")


def test_plural():
    assert [plural(n, "thread") for n in (0, 1, 2)] == ["0 threads", "1 thread", "2 threads"]
    assert plural(1.0, "CPU") == "1 CPU" and plural(0.5, "CPU") == "0.5 CPUs"
    assert plural(3, "batch", "batches") == "3 batches"


def test_disabled_writes_nothing_and_a_terminal_gets_tqdm():
    out = io.StringIO()
    bar = progress(5, "x", file=out, disable=True)
    bar.update(5)
    bar.close()
    assert out.getvalue() == ""

    from tqdm import tqdm

    term = FakeTerminal()
    bar = progress(5, "x", "it", file=term, leave=False, dynamic_ncols=True)
    assert isinstance(bar, tqdm) and not isinstance(bar, LineProgress)
    bar.update(5)
    bar.close()


def test_offline_generate_logs_two_lines_to_a_non_terminal_stderr(capsys):
    from stepserve import Engine, SamplingParams
    from stepserve.engine.clock import SimClock
    from stepserve.costs import FakeExecutor

    engine = Engine(FakeExecutor(), clock=SimClock(), strategy="continuous", max_batch_size=8)
    results = engine.generate([SamplingParams(prompt="p", seed=i, num_inference_steps=3) for i in range(200)],
                              progress=True)
    assert all(r.ok for r in results)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines()[0] == "generate (continuous): started (200 images)"
    assert len(err.splitlines()) == 2 and "done 200 images" in err
