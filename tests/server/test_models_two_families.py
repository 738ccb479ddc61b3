"""One server of a tiny SD and a tiny Flux.1: requests for both, of mixed sizes, steps and guidance, sent together,
each equal to diffusers' own pipeline run alone (uint8 within 1), under slo and continuous; GET /v1/models lists
both, with their family and place; a request for a model not served gets 404 model_not_found, while the others
are answered."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from family_reference import reference_image
from several_models import body_of, front_of, image_of, tiny_flux

from stepserve import SamplingParams

pytestmark = pytest.mark.usefixtures("batching_pays")


def sd_params(i: int) -> SamplingParams:
    return SamplingParams(prompt=["a red fox", "seven", "blue sky"][i % 3] + f" {i}", seed=40 + 7 * i,
                          negative_prompt=["", "blurry"][i % 2], num_inference_steps=[3, 5, 4][i % 3],
                          guidance_scale=[4.5, 1.0, 7.0][i % 3], sampler=["dpmpp_2m", "euler_a", "ddim"][i % 3],
                          height=[16, 24][i % 2], width=16)


def flux_params(i: int) -> SamplingParams:
    return SamplingParams(prompt=["a red fox", "zz top at dawn"][i % 2] + f" {i}", seed=2000 + 31 * i,
                          num_inference_steps=[2, 4, 3][i % 3], guidance_scale=[3.5, 1.0, 6.0][i % 3],
                          sampler="flow_euler", height=[32, 48][i % 2], width=32)


CASES = [("sd", sd_params(i)) for i in range(3)] + [("flux", flux_params(i)) for i in range(3)]


@pytest.fixture(scope="module")
def tiny_flux_path(tmp_path_factory):
    return tiny_flux(tmp_path_factory.mktemp("flux"))


@pytest.fixture(scope="module")
def references(tiny_sd_path, tiny_flux_path):
    paths = {"sd": tiny_sd_path, "flux": tiny_flux_path}
    return [reference_image(family, paths[family], p) for family, p in CASES]


@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_two_families_served_together_equal_diffusers(tiny_sd_path, tiny_flux_path, references, strategy):
    with front_of("--model", f"sd={tiny_sd_path}", "--model", f"flux={tiny_flux_path}", "--strategy", strategy,
                  "--max-batch-size", "4") as (server, front):
        with httpx.Client(base_url=server.url, timeout=300) as client:
            def post(case):
                model, p = case
                return client.post("/v1/images/generations", json=body_of(model, p))

            with ThreadPoolExecutor(len(CASES) + 1) as pool:
                answers = list(pool.map(post, [*CASES, ("nope", sd_params(0))]))
            models = client.get("/v1/models").json()["data"]
        steps = {name: front.models.device.models[name].steps for name in ("sd", "flux")}
    *served, unknown = answers
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert "sd, flux" in unknown.json()["error"]["message"]
    for (model, p), answer, ref in zip(CASES, served, references):
        assert answer.status_code == 200, answer.text
        diff = np.abs(image_of(answer.json()) - ref)
        assert diff.max() <= 1, (model, p, diff.max())
    assert [(m["id"], m["family"], m["place"]) for m in models] == [("sd", "sd", "device"), ("flux", "flux", "device")]
    assert steps["sd"] > 0 and steps["flux"] > 0  # both took turns on the one device


def test_a_model_is_named_by_its_aliases_and_the_default_takes_requests_without_one(tiny_sd_path, tiny_flux_path):
    with front_of("--model", f"sd={tiny_sd_path}", "--model", f"flux={tiny_flux_path}", "--default-model", "flux",
                  "--served-model-name", "dall-e-3", "--strategy", "continuous") as (server, front):
        with httpx.Client(base_url=server.url, timeout=300) as client:
            plain = client.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 2})
            alias = client.post("/v1/images/generations", json={"prompt": "x", "model": "dall-e-3",
                                                                "num_inference_steps": 2})
            one = client.get("/v1/models/dall-e-3").json()
            missing = client.get("/v1/models/nope")
    assert plain.status_code == 200 and alias.status_code == 200
    assert front.models.device.models["flux"].steps > 0 and front.models.device.models["sd"].steps == 0
    assert one["id"] == "dall-e-3" and one["family"] == "flux" and one["default"] is True
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_one_server_of_two_models_keeps_their_jobs_apart(tiny_sd_path, tiny_flux_path, references):
    """Async jobs of each model run on that model and are found through the front; each model's listing and
    deletion see its own jobs only (jobs belong to a model: the hardening round's scoping, per model)."""
    import time

    with front_of("--model", f"sd={tiny_sd_path}", "--model", f"flux={tiny_flux_path}",
                  "--strategy", "continuous") as (server, front):
        with httpx.Client(base_url=server.url, timeout=300, headers={"Prefer": "respond-async"}) as client:
            ids = {}
            for (model, p) in (CASES[0], CASES[3]):
                created = client.post("/v1/images/generations", json=body_of(model, p))
                assert created.status_code == 202, created.text
                ids[model] = created.json()["id"]
            done = {}
            deadline = time.monotonic() + 300  # bounds a hang only
            while len(done) < 2 and time.monotonic() < deadline:
                for model, job in ids.items():
                    answer = client.get(f"/v1/images/jobs/{job}").json()
                    if answer["status"] in ("completed", "failed"):
                        done[model] = answer
                time.sleep(0.05)  # the jobs tell their status only when asked
            listed = {m: [j["id"] for j in client.get(f"/v1/images/jobs?model={m}").json()["data"]]
                      for m in ("sd", "flux")}
            crossed = client.delete(f"/v1/images/jobs/{ids['flux']}?model=sd")
            still = client.get(f"/v1/images/jobs/{ids['flux']}")
    assert listed == {"sd": [ids["sd"]], "flux": [ids["flux"]]}
    assert crossed.status_code == 404 and still.status_code == 200  # sd's app cannot delete flux's job
    for (model, p), ref in ((CASES[0], references[0]), (CASES[3], references[3])):
        assert done[model]["status"] == "completed", done[model]
        diff = np.abs(image_of(done[model]["result"]) - ref)
        assert diff.max() <= 1, (model, diff.max())
    services = {e.name: e.app.state.server.jobs.service for e in front.models.entries.values() if e.app}
    assert services["sd"] != services["flux"]


def test_an_edit_goes_to_the_model_its_form_names(tiny_sd_path, tiny_flux_path):
    import io

    from edit_images import start_image

    picture = io.BytesIO()
    start_image(1, size=32).save(picture, format="PNG")
    files = {"image": ("a.png", picture.getvalue(), "image/png")}
    with front_of("--model", f"sd={tiny_sd_path}", "--model", f"flux={tiny_flux_path}",
                  "--strategy", "continuous") as (server, front):
        with httpx.Client(base_url=server.url, timeout=300) as client:
            edit = client.post("/v1/images/edits", files=files, data={"model": "flux", "prompt": "a fox",
                                                                      "size": "32x32", "num_inference_steps": "2"})
            unknown = client.post("/v1/images/edits", files=files, data={"model": "nope", "prompt": "a fox"})
        steps = {name: front.models.device.models[name].steps for name in ("sd", "flux")}
    assert edit.status_code == 200, edit.text
    assert steps["flux"] > 0 and steps["sd"] == 0
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
