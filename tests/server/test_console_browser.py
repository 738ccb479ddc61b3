"""The web console in a real browser (headless Chromium, driven by Playwright) against a live server on the
embedded model: a prompt submitted in the playground comes back as an image; lanes join and leave the live view
while a small background load runs; with an API key set the page refuses until the key is entered. Screenshots
are kept in $STEPSERVE_TEST_ARTIFACTS/console, else test-artifacts/console."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from extras import require
from server_helpers import wait_until

CHROMIUM = os.environ.get("STEPSERVE_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    sync_api = require("playwright.sync_api", "test")
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        message = f"no Chromium at {CHROMIUM}: install Debian's chromium package (the README's set-up; CI does)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def embedded():
    from stepserve.engine.loading import load_executor

    return load_executor("embedded")


@pytest.fixture
def shots():
    """Where the screenshots are kept: $STEPSERVE_TEST_ARTIFACTS/console, else test-artifacts/console in the
    repository (ignored by git), so a run's pictures can be looked at afterwards."""
    root = os.environ.get("STEPSERVE_TEST_ARTIFACTS") or Path(__file__).resolve().parents[2] / "test-artifacts"
    folder = Path(root) / "console"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def background_load(url: str, stop: threading.Event, headers=None) -> threading.Thread:
    """Requests of mixed step counts, a few at a time, until stopped."""
    def run():
        i = 0
        with httpx.Client(timeout=60, headers=headers) as client:
            while not stop.is_set():
                client.post(url + "/v1/images/generations", json={"prompt": "a handwritten three", "n": 2,
                                                                  "num_inference_steps": [6, 12, 20][i % 3],
                                                                  "seed": i})
                i += 1

    threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    return threads


def test_playground_and_live_lanes(serve, browser, embedded, shots):
    with serve(strategy="continuous", executor=embedded, max_batch_size=8) as server:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(server.url + "/")
        page.wait_for_selector("#status.live", timeout=120_000)
        assert page.locator("#key-form").is_hidden()
        page.fill("#prompt", "a handwritten seven")
        page.fill("#seed", "7")
        assert page.locator("#negative").is_visible()  # the embedded model takes a negative prompt
        page.fill("#negative", "a three")
        with page.expect_request(lambda r: r.url.endswith("/v1/images/generations")) as sent:
            page.click("#generate")
        body = sent.value.post_data_json
        assert (body["prompt"], body["negative_prompt"], body["seed"]) == ("a handwritten seven", "a three", 7)
        final = page.wait_for_selector("img.result-image[data-final='1']", timeout=240_000)
        assert final.get_attribute("src").startswith("data:image/png;base64,")
        assert "denoising" in page.inner_text(".result .timing")
        page.screenshot(path=str(shots / "playground.png"))

        stop = threading.Event()
        load = background_load(server.url, stop)
        try:
            page.wait_for_function("Number(document.getElementById('live-left').textContent) >= 6",
                                   timeout=240_000)
            joined = int(page.inner_text("#live-joined"))
            left = int(page.inner_text("#live-left"))
            assert joined >= left >= 6
            lanes = page.evaluate("() => { const c = document.getElementById('lanes');"
                                  " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
                                  " let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }")
            assert lanes > 500  # lanes were drawn
            rows = page.locator("#latency-table tbody tr")
            assert rows.count() >= 2 and "ms" in page.inner_text("#latency-table")
            page.screenshot(path=str(shots / "live.png"))
            page.locator("#live").screenshot(path=str(shots / "live-batch-view.png"))
        finally:
            stop.set()
            for t in load:
                t.join(60)
        page.close()


def test_with_a_key_the_page_refuses_until_it_is_entered(serve, browser, embedded, shots):
    with serve(strategy="continuous", executor=embedded, api_key="open sesame") as server:
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#key-form:not([hidden])", timeout=120_000)
        assert page.locator("#console").is_hidden() and page.inner_text("#status") == "offline"
        page.fill("#key-input", "wrong")
        page.click("#key-submit")
        page.wait_for_selector("#key-error:not([hidden])", timeout=120_000)
        assert "refused" in page.inner_text("#key-error") and page.locator("#console").is_hidden()
        page.screenshot(path=str(shots / "key-refused.png"))
        page.fill("#key-input", "open sesame")
        page.click("#key-submit")
        page.wait_for_selector("#status.live", timeout=120_000)
        assert page.locator("#key-form").is_hidden()
        assert "open sesame" not in page.url and page.evaluate("() => localStorage.length + sessionStorage.length") == 0
        page.fill("#prompt", "a handwritten two")
        page.click("#generate")
        page.wait_for_selector("img.result-image[data-final='1']", timeout=240_000)
        page.close()


def test_a_model_without_negative_prompts_has_no_field_for_one(serve, browser, tmp_path):
    """Flux.1 [dev] (guidance distilled into the transformer) takes no negative prompt: the playground hides the
    field, and a request from it carries none even with text left in the field (the server would refuse one)."""
    from stepserve.engine.loading import load_executor
    from stepserve.tiny.flux import build_tiny_flux

    flux = load_executor(str(build_tiny_flux(tmp_path / "flux")))
    assert flux.model_info.negative_prompt is False
    with serve(strategy="continuous", executor=flux) as server:
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#status.live", timeout=120_000)
        assert page.locator("#negative").is_hidden()
        page.evaluate("() => { document.getElementById('negative').value = 'left over'; }")  # text in the hidden field
        page.fill("#steps", "2")
        with page.expect_request(lambda r: r.url.endswith("/v1/images/generations")) as sent:
            page.click("#generate")
        assert "negative_prompt" not in sent.value.post_data_json
        page.wait_for_selector("img.result-image[data-final='1']", timeout=240_000)
        page.close()


def test_lanes_of_two_replicas_show_up_under_their_names(browser, shots):
    """Behind several replicas the page gets every replica's steps through one stream (here two engines forward
    to one hub, as under Ray: fleet_helpers.py) and shows each replica's lanes and numbers under its name."""
    from fleet_helpers import fleet

    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.engine.loading import load_executor
    from stepserve.server.app import create_app

    def make_app(key):
        return create_app(AsyncEngine(load_executor("embedded"), strategy="continuous", max_batch_size=4),
                          api_key=key, shutdown_grace_s=5.0)

    with fleet(make_app, names=("r-alpha", "r-beta")) as f:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f.url + "/")
        page.wait_for_selector("#status.live", timeout=120_000)
        page.wait_for_selector("#live-replicas .replica[data-replica='r-beta']", timeout=120_000)
        assert "2 replicas" in page.inner_text("#model")
        stop = threading.Event()
        load = [t for url in f.urls.values() for t in background_load(url, stop)]
        try:
            for name in f.urls:  # each replica's line counts its own steps
                page.wait_for_function(
                    f"(document.querySelector(\"#live-replicas .replica[data-replica='{name}']\") || {{}})"
                    f".textContent?.match(/: [1-9][0-9]* steps/)", timeout=240_000)
            lines = page.locator("#live-replicas .replica").all_inner_texts()
            assert [line.split(":")[0] for line in lines] == ["r-alpha", "r-beta"]
            page.wait_for_function("Number(document.getElementById('live-left').textContent) >= 4",
                                   timeout=240_000)
            page.locator("#live").screenshot(path=str(shots / "live-two-replicas.png"))
        finally:
            stop.set()
            for t in load:
                t.join(60)
        page.close()


def test_the_playground_sends_a_control_image_and_an_image_prompt(serve, browser, tmp_path, shots, tiny_sd_path):
    """With ControlNets and IP-Adapters served, the playground shows their fields; a chosen ControlNet and image
    go with the request (as a data: URL, with canny when asked), so does a chosen IP-Adapter with its image and
    scale, and the image comes back made with both."""
    import io

    from control_reference import build_controlnets
    from edit_images import start_image
    from ip_adapter_reference import build_ip_adapters

    from stepserve.controls.serving import serve_controlnets
    from stepserve.engine.loading import load_executor
    from stepserve.ipadapter.serving import serve_ip_adapters

    executor = load_executor(str(tiny_sd_path))
    serve_controlnets(executor, str(build_controlnets(tiny_sd_path, tmp_path / "controlnets")), None)
    serve_ip_adapters(executor, str(build_ip_adapters(tiny_sd_path, tmp_path / "ip_adapters")))
    picture = tmp_path / "map.png"
    buffer = io.BytesIO()
    start_image(3, size=32).save(buffer, format="PNG")
    picture.write_bytes(buffer.getvalue())
    with serve(strategy="continuous", executor=executor) as server:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(server.url + "/")
        page.wait_for_selector("#status.live", timeout=120_000)
        assert page.locator("#control-set").is_visible()
        assert page.locator("#control-name option").all_inner_texts() == ["none", "depth", "edge", "pose"]
        page.select_option("#control-name", "edge")
        page.click("#generate")  # no image chosen: said on the card, nothing sent
        page.wait_for_selector(".result .error:not([hidden])", timeout=60_000)
        assert "choose a control image" in page.inner_text(".result .error")
        page.set_input_files("#control-image", str(picture))
        page.fill("#control-scale", "0.7")
        page.check("#control-canny")
        assert page.locator("#ip-name option").all_inner_texts() == ["none", "face", "style"]
        page.select_option("#ip-name", "style")
        page.click("#generate")  # no image prompt picture chosen: said on the card, nothing sent
        page.wait_for_function("[...document.querySelectorAll('.result .error')].some(e => e.textContent"
                               ".includes('choose an image for the image prompt'))", timeout=60_000)
        page.set_input_files("#ip-image", str(picture))
        page.fill("#ip-scale", "0.6")
        page.fill("#steps", "3")
        with page.expect_request(lambda r: r.url.endswith("/v1/images/generations")) as sent:
            page.click("#generate")
        [control] = sent.value.post_data_json["controls"]
        assert (control["name"], control["scale"], control["preprocess"]) == ("edge", 0.7, "canny")
        assert control["image"].startswith("data:image/png;base64,")
        prompt = sent.value.post_data_json["ip_adapter"]
        assert (prompt["name"], prompt["scale"]) == ("style", 0.6) and prompt["image"].startswith("data:image/png")
        page.wait_for_selector("img.result-image[data-final='1']", timeout=240_000)
        loaded = httpx.get(server.url + "/v1/controlnets").json()["data"]
        assert {c["name"]: c["loaded"] for c in loaded}["edge"] is True  # the request ran with it
        adapters = httpx.get(server.url + "/v1/ip-adapters").json()["data"]
        assert {a["name"]: a["loaded"] for a in adapters} == {"face": False, "style": True}
        page.locator("#playground").screenshot(path=str(shots / "playground-controlnet.png"))
        page.close()


def test_two_models_show_a_lane_group_each_and_which_held_the_device(browser, tmp_path, tiny_sd_path, shots):
    """A server of a tiny SD and a tiny Flux.1: the page lists both, the playground's selector sets the request's
    model (and its form is that model's: Flux takes no negative prompt), each model gets its lane group, and the
    device strip shows both models' steps (taken in turns, in each model's colour)."""
    from two_models import two_models

    from stepserve.tiny.flux import build_tiny_flux

    flux = build_tiny_flux(tmp_path / "flux")
    with two_models({"sd": str(tiny_sd_path), "flux": str(flux)}) as (server, models):
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(server.url + "/")
        page.wait_for_selector("#status.live", timeout=120_000)
        assert page.locator("#model-choice option").all_inner_texts() == ["sd", "flux"]
        assert page.input_value("#model-choice") == "sd" and "2 models" in page.inner_text("#model")
        page.wait_for_selector("#negative", state="visible", timeout=120_000)  # sd's form, from its stream
        page.select_option("#model-choice", "flux")
        page.wait_for_selector("#negative", state="hidden", timeout=120_000)  # flux's form
        page.fill("#steps", "4")
        device = models.device
        with device._exclusive():  # both models' requests wait for the device: their steps then take turns
            with page.expect_request(lambda r: r.url.endswith("/v1/images/generations")) as sent:
                page.click("#generate")
            other = threading.Thread(target=httpx.post, args=(server.url + "/v1/images/generations",), kwargs={
                "json": {"prompt": "a two", "model": "sd", "num_inference_steps": 6}, "timeout": 240})
            other.start()
            assert wait_until(lambda: len(device._bids) == 2, 240)
        body = sent.value.post_data_json
        assert body["model"] == "flux" and body["num_inference_steps"] == 4 and "negative_prompt" not in body
        page.wait_for_selector("img.result-image[data-final='1']", timeout=240_000)
        other.join(240)
        for name in ("sd", "flux"):  # a lane group and a device legend each, counting that model's steps
            page.wait_for_function(f"/: [1-9][0-9]* steps/.test(document.querySelector(\"#device-legend "
                                   f".model[data-model='{name}']\")?.textContent || '')", timeout=240_000)
            assert page.locator(f"#live-replicas .replica[data-model='{name}']").count() == 1
        assert page.evaluate("() => [...groups.keys()]") == ["sd", "flux"]
        page.wait_for_function("document.querySelectorAll('#latency-table tbody tr').length === 3", timeout=240_000)
        rows = [r.split("\t")[0] for r in page.locator("#latency-table tbody tr").all_inner_texts()]
        assert rows == ["sd · 6", "flux · 4", "all"]  # the recent latency per model and step count
        colours = page.evaluate("""() => {  // the strip's pixels in each model's colour
            const c = document.getElementById('device');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const count = (hex) => {
              const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
              let n = 0;
              for (let i = 0; i < d.length; i += 4) n += d[i] === r && d[i + 1] === g && d[i + 2] === b;
              return n; };
            return Object.fromEntries(['sd', 'flux'].map((m) => [m, count(modelColour(m))])); }""")
        assert colours["sd"] > 20 and colours["flux"] > 20, colours  # a step is a bar 24 px high
        page.locator("#live").screenshot(path=str(shots / "live-two-models.png"))
        page.close()


def test_a_model_on_disk_gets_its_lanes_once_a_request_loads_it(browser, tmp_path):
    """Watching loads nothing: a model on disk is listed with no stream, its form says its first request loads it;
    once the playground's request has loaded it, the page opens its stream (it looks at /v1/models)."""
    from two_models import two_models

    from stepserve.tiny.flux import build_tiny_flux

    flux = build_tiny_flux(tmp_path / "flux")
    with two_models({"sd": "embedded", "flux": str(flux)}, eager=("sd",)) as (server, models):
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(server.url + "/")
        page.wait_for_selector("#status.live", timeout=120_000)
        page.wait_for_selector("#device-legend .model[data-model='flux']", timeout=120_000)
        assert "flux (disk): 0 steps" in page.inner_text("#device-legend")
        page.select_option("#model-choice", "flux")
        assert "flux is on disk: its first request loads it" in page.inner_text("#model-note")
        assert models.entries["flux"].stack is None  # the page loaded nothing
        with page.expect_request(lambda r: r.url.endswith("/v1/images/generations")) as sent:
            page.click("#generate")
        assert sent.value.post_data_json["model"] == "flux" and "size" not in sent.value.post_data_json
        page.wait_for_selector("img.result-image[data-final='1']", timeout=240_000)
        page.wait_for_function("Number(document.getElementById('steps').value) > 0", timeout=120_000)  # its form
        assert page.locator("#negative").is_hidden()  # Flux's own form: no negative prompt
        assert page.locator("#model-note").is_hidden()
        httpx.post(server.url + "/v1/images/generations", json={"prompt": "a two", "model": "flux",
                                                               "num_inference_steps": 2}, timeout=240)
        page.wait_for_function("/flux \\(device\\): [1-9][0-9]* steps/.test(document.getElementById("
                               "'device-legend').textContent)", timeout=240_000)
        page.close()
