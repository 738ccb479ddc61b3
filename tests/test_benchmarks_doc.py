"""docs/BENCHMARKS.md opens with one page of current results: a line per benchmark with its result, the command
that reproduces it and the date it was recorded, every number and command taken from the notes below it."""

from __future__ import annotations

import re
from pathlib import Path

DOC = (Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md").read_text()


def summary_and_notes() -> tuple[list[list[str]], str]:
    head, notes = DOC.split("\n## Engine overhead at saturation", 1)
    assert "\n## Current results\n" in head, "BENCHMARKS.md does not open with its current results"
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in head.splitlines()
            if line.startswith("| ") and not line.startswith("| benchmark |")]
    return rows, "## Engine overhead at saturation" + notes


def test_the_first_page_has_a_line_per_benchmark_of_the_notes():
    rows, notes = summary_and_notes()
    sections = re.findall(r"^## (.+)$", notes, re.M)
    assert len(rows) >= len(sections) - 1 and len(rows) <= 30, (len(rows), len(sections))
    assert all(len(row) == 4 for row in rows), rows
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", row[3]) for row in rows), [row[3] for row in rows]
    assert len(DOC.split("\n## Engine overhead at saturation", 1)[0].splitlines()) <= 45  # one page


def test_every_number_and_command_of_the_first_page_is_in_the_notes():
    rows, notes = summary_and_notes()
    flat = " ".join(notes.split()).replace("**", "")
    for _, result, command, _ in rows:
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", result):
            assert number in flat, f"{number} (in {result!r}) is not in the notes"
        command = command.strip("`").split("` (")[0].split(" ...")[0]
        assert " ".join(command.split()) in " ".join(notes.replace("\\\n", " ").split()), command
