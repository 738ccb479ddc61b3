"""The README's setup instructions agree with the Makefile they describe."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_states_the_makefile_torch_pin_and_how_to_choose_another_build():
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH_SPEC \?= (\S+)$", makefile, re.M).group(1)
    assert '"$(TORCH_SPEC)"' in makefile  # one requirement string: TORCH_SPEC cannot carry an --index-url
    assert 'import torch" 2>/dev/null ||' in makefile  # a torch already in .venv is kept
    quickstart = (ROOT / "README.md").read_text().split("## Setup", 1)[1].split("\n## ", 1)[0]
    assert f"pip install {pin}" in quickstart
    assert "TORCH_SPEC" in quickstart and "download.pytorch.org/whl/cpu" in quickstart  # plain PyPI, CPU only
    assert "--index-url https://download.pytorch.org/whl/cu" in quickstart  # a GPU machine


def test_readme_lists_every_extra_of_pyproject_once_with_what_make_test_installs():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    quickstart = (ROOT / "README.md").read_text().split("## Setup", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- `([a-z]+)`: ", quickstart, re.M)
    assert sorted(listed) == sorted(extras), listed  # one line each, none missing, none invented
    makefile = (ROOT / "Makefile").read_text()
    installed = set(re.search(r'pip install -q -e "\.\[([a-z,]+)\]"\n', makefile.split(".extras:", 1)[1]).group(1)
                    .split(","))
    left_out = sorted(set(extras) - installed)
    sentence = quickstart.split("`make test` installs every extra but ", 1)[1].split(";", 1)[0]
    assert left_out and set(re.findall(r"`([a-z]+)`", sentence)) - {"test"} == set(left_out), sentence


def test_the_quickstart_is_on_the_first_screen():
    """A new reader sees the two commands (make demo, make test), how to start a server, ask it for an image and
    open the console before any feature paragraph: the Quickstart is the first section, within the first 40
    lines."""
    readme = (ROOT / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:40])
    assert readme.split("\n## ", 1)[1].startswith("Quickstart\n")  # the first section
    quickstart = first_screen.split("## Quickstart", 1)[1]
    for needed in ("make demo", "make test", "stepserve serve", "curl -s localhost:8000/v1/images/generations",
                   "http://127.0.0.1:8000/"):
        assert needed in quickstart, needed
