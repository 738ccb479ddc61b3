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
    quickstart = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert f"pip install {pin}" in quickstart
    assert "TORCH_SPEC" in quickstart and "download.pytorch.org/whl/cpu" in quickstart  # plain PyPI, CPU only
    assert "--index-url https://download.pytorch.org/whl/cu" in quickstart  # a GPU machine
