"""Writing a Triton repository touches only what it writes: a rewrite keeps a .git and other models, a foreign
non-empty folder needs --force (and keeps its contents), and a manifest's file names never lead out of the
export folder."""

from __future__ import annotations

import json
import shutil

import pytest

from stepserve.commands.export_triton import main as export_main
from stepserve.deploy.triton.repository import RepositoryOptions, write_repository


def _user_files(folder):
    (folder / ".git").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "other_model" / "1").mkdir(parents=True)
    (folder / "other_model" / "config.pbtxt").write_text('name: "other_model"\n')


def _kept(folder):
    return (folder / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n" \
        and (folder / "other_model" / "config.pbtxt").is_file()


def test_rewriting_a_repository_keeps_what_it_did_not_write(embedded_onnx, tmp_path):
    repo = write_repository(embedded_onnx, tmp_path / "r", RepositoryOptions(mode="classic"), quiet=True)
    _user_files(repo)
    write_repository(embedded_onnx, repo, RepositoryOptions(mode="stepserve"), quiet=True)
    assert _kept(repo)
    assert sorted(p.name for p in repo.iterdir()) == [".git", "other_model", "pipeline", "stepserve-triton.json"]
    assert json.loads((repo / "stepserve-triton.json").read_text())["mode"] == "stepserve"


def test_a_foreign_folder_needs_force_and_keeps_its_contents(embedded_onnx, tmp_path, capsys):
    repo = tmp_path / "models"
    _user_files(repo)
    argv = ["--model", str(embedded_onnx), "--out", str(repo), "--mode", "classic"]
    assert export_main(argv) == 2
    assert "--force" in capsys.readouterr().err
    assert sorted(p.name for p in repo.iterdir()) == [".git", "other_model"]
    assert export_main(argv + ["--force"]) == 0
    assert _kept(repo) and (repo / "pipeline" / "config.pbtxt").is_file() and (repo / "unet" / "1" / "model.onnx")\
        .is_file()
    assert not list(repo.glob(".staging-*"))


@pytest.mark.parametrize("escape", ["absolute", "relative"])
def test_a_manifest_cannot_name_a_file_outside_the_export(embedded_onnx, tmp_path, escape):
    secret = tmp_path / "secret.txt"
    secret.write_text("not a graph")
    export = tmp_path / "export"
    shutil.copytree(embedded_onnx, export)
    manifest = json.loads((export / "manifest.json").read_text())
    # the repository is staged in out/.staging-*/, the export copied to pipeline/1/export/ inside it
    manifest["networks"]["unet"]["file"] = str(secret) if escape == "absolute" else "../../../../../secret.txt"
    (export / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="networks.unet.file .* is not a file inside the export folder"):
        write_repository(export, tmp_path / "repo", RepositoryOptions(mode="classic"), quiet=True)
    assert secret.read_text() == "not a graph"
    assert list((tmp_path / "repo").iterdir()) == []
