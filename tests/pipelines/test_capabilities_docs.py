"""The docs say what the families' declarations (stepserve/capabilities.py) say: docs/MODELS.md's table of features
is the one made from them and its list of pairs refused at start-up is PAIRS_REFUSED; docs/CONTROLNET.md, the
HTTP reference and the README name the families that serve ControlNets, IP-Adapters, guess mode, caching with
controls and inpainting as the declarations do."""

import re
from pathlib import Path

import pytest

from stepserve.engine.loading import STARTUP_FLAGS
from stepserve import capabilities as caps
from stepserve.capabilities import served_for

ROOT = Path(__file__).resolve().parents[2]


def text(name: str) -> str:
    """The page with its lines joined (sentences wrap anywhere)."""
    return " ".join((ROOT / name).read_text().split())


def test_models_md_table_is_made_from_the_declarations():
    assert caps.markdown_table() in (ROOT / "docs/MODELS.md").read_text()


def test_models_md_lists_every_pair_refused_at_start_up_and_why():
    page = (ROOT / "docs/MODELS.md").read_text()
    listed = re.findall(r"^\| `([^`]+)` with `([^`]+)` \| (.+) \|$", page, re.M)
    declared = {(*sorted(STARTUP_FLAGS[x] for x in pair), why) for pair, why in caps.PAIRS_REFUSED.items()}
    assert set(listed) == declared
    for why in set(caps.PAIRS_REFUSED_PER_REQUEST.values()):
        assert why in text("docs/MODELS.md")


@pytest.mark.parametrize("page,phrase", [
    ("docs/CONTROLNET.md", f"**Families**: {served_for('controlnets')} on the torch backend"),
    ("docs/CONTROLNET.md", f"IP-Adapters: below ({served_for('ip_adapter')})"),
    ("docs/CONTROLNET.md", f"**Families**: {served_for('ip_adapter')} on the torch backend"),
    ("docs/CONTROLNET.md", f"**Guess mode**: {served_for('guess_mode')}"),
    ("docs/CONTROLNET.md", f"**Step caching with controls on {served_for('caches_with_controls')}**"),
    ("docs/HTTP_API.md", f"ControlNets for this image ({served_for('controlnets')}; with an image: "
                         f"{served_for('controls_with_image')}"),
    ("docs/HTTP_API.md", f"an image as a prompt (IP-Adapter; {served_for('ip_adapter')};"),
    ("README.md", f"**ControlNets per request.** {served_for('controlnets')} requests"),
    ("README.md", f"On {served_for('ip_adapter')} an image can be a prompt"),
    ("README.md", f"Inpainting (`mask`, {served_for('inpaint')}:"),
    ("README.md", f"{served_for('img2img')} equal their diffusers img2img pipelines"),
])
def test_pages_name_the_families_the_declarations_name(page, phrase):
    assert phrase in text(page)


def test_controlnet_md_table_has_a_row_per_family_that_runs_controlnets():
    page = (ROOT / "docs/CONTROLNET.md").read_text()
    table = page[page.index("| family | ControlNet |"):].split("\n\n")[0].splitlines()[2:]
    firsts = [row.split("|")[1].strip() for row in table]
    titles = [c.title for c in caps.FAMILIES.values() if c.controlnets]
    assert len(firsts) == len(titles) and all(f.startswith(t) for f, t in zip(firsts, titles)), firsts
