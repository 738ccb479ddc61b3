"""The results folder (stepserve/store/results.py): atomic writes, names that cannot leave the folder, the sweep of
old files and of temporary files a dead writer left, and several processes writing and sweeping one folder."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from stepserve.store.results import Results


def test_write_read_delete(tmp_path):
    results = Results(tmp_path / "r", keep_s=60)
    assert results.write("video_1.mp4", b"abc") == "video_1.mp4"
    assert results.read("video_1.mp4") == b"abc" and results.path("video_1.mp4") == tmp_path / "r" / "video_1.mp4"
    results.write("video_1.mp4", b"second")  # replaced whole
    assert results.read("video_1.mp4") == b"second"
    results.delete(["video_1.mp4", "never_written.mp4"])
    assert results.read("video_1.mp4") is None
    assert os.listdir(tmp_path / "r") == []  # no temporary file left behind


@pytest.mark.parametrize("name", ["../x", "a/b", "/etc/passwd", ".hidden", "..", "", "a\x00b", "a b", "x" * 201])
def test_names_that_are_not_plain_file_names_are_refused(tmp_path, name):
    results = Results(tmp_path, keep_s=60)
    with pytest.raises(ValueError, match="not a result file name"):
        results.path(name)
    with pytest.raises(ValueError):
        results.write(name, b"x")


def test_a_failed_write_leaves_neither_the_file_nor_its_temporary(tmp_path, monkeypatch):
    results = Results(tmp_path, keep_s=60)
    results.write("a.json", b"old")

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError, match="disk full"):
        results.write("a.json", b"new")
    assert sorted(os.listdir(tmp_path)) == ["a.json"] and results.read("a.json") == b"old"


def test_sweep_removes_old_files_and_leftover_temporaries_only(tmp_path):
    results = Results(tmp_path, keep_s=3600)
    now = time.time()
    for name, age in (("old.mp4", 3601), ("young.mp4", 3500), (".young.mp4.abc.tmp", 30), (".dead.mp4.abc.tmp", 61)):
        path = tmp_path / name
        path.write_bytes(b"x")
        os.utime(path, (now - age, now - age))
    (tmp_path / "a_folder").mkdir()
    assert sorted(results.sweep(now)) == [".dead.mp4.abc.tmp", "old.mp4"]
    assert sorted(os.listdir(tmp_path)) == [".young.mp4.abc.tmp", "a_folder", "young.mp4"]
    results.touch(["young.mp4"])  # made young again: a later sweep keeps it (the temporary is dead by then)
    assert results.sweep(now + 200) == [".young.mp4.abc.tmp"] and os.listdir(tmp_path) != []
    assert sorted(os.listdir(tmp_path)) == ["a_folder", "young.mp4"]


def _writer(root: str, worker: int, rounds: int) -> None:
    results = Results(root, keep_s=1e-6)  # every finished file is old enough to sweep; a write in progress is not
    for i in range(rounds):
        results.write("shared.bin", bytes([worker]) * 200_000)  # every reader sees one writer's whole file
        results.write(f"own_{worker}_{i}.bin", b"x")
        results.sweep(time.time())  # sweeps the others' files too: nobody fails for a file gone


def test_several_processes_write_and_sweep_one_folder(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_writer, args=(str(tmp_path), w, 30)) for w in (1, 2)]
    for w in workers:
        w.start()
    results = Results(tmp_path, keep_s=3600)
    while any(w.is_alive() for w in workers):
        data = results.read("shared.bin")
        if data is not None:
            assert len(data) == 200_000 and len(set(data)) == 1, "a torn file"
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []


def test_a_temporary_folder_is_removed_at_close():
    results = Results.in_temporary_folder()
    results.write("a.mp4", b"x")
    assert results.root.exists()
    results.close()
    assert not results.root.exists()
