"""The configuration of a server of several models: --model [NAME=]PATH repeated, --models FILE (TOML, per-model
settings named as the flags), --models-dir (each sub-folder a model, loaded on its first request), --default-model;
each mistake is one line naming what is allowed."""

import argparse

import httpx
import pytest
from several_models import front_of

from stepserve.commands.models_flags import model_entries, model_specs, several
from stepserve.commands.serve import build_parser, check_model, serve_settings
from stepserve.server.startup import StartupError


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["--no-memory-cap", "--state", "memory", *flags])


def specs(*flags: str):
    def config_of(own):
        check_model(own)
        return serve_settings(own).engine

    return model_specs(parse(*flags), config_of, build_parser())


def test_one_plain_model_is_the_server_of_one_model_as_before():
    assert not several(parse()) and not several(parse("--model", "embedded"))
    assert several(parse("--model", "a=embedded")) and several(parse("--model", "embedded", "--model", "x=embedded"))


def test_names_default_to_the_folder_and_a_path_with_equals_stays_a_path(tiny_sd_path, tmp_path):
    odd = tmp_path / "a=b"
    entries, _ = model_entries(parse("--model", str(tiny_sd_path), "--model", f"two={tiny_sd_path}",
                                     "--model", f"odd={odd}"))
    assert [(n, s["model"]) for n, s, _ in entries] == [(tiny_sd_path.name, str(tiny_sd_path)),
                                                        ("two", str(tiny_sd_path)), ("odd", str(odd))]
    with pytest.raises(StartupError, match="model name 'a=b': allowed: .* \\(give NAME=PATH\\)"):
        model_entries(parse("--model", str(odd)))  # its folder's name is not a name: one must be given


def test_a_toml_file_gives_each_model_its_own_settings(tiny_sd_path, tmp_path):
    file = tmp_path / "models.toml"
    file.write_text(f'default = "fast"\n[models.fast]\npath = "{tiny_sd_path}"\nstrategy = "continuous"\n'
                    f'max-batch-size = 2\nserved-model-name = ["dall-e-2"]\nweight = 3\n'
                    f'[models.final]\npath = "embedded"\ndtype = "bfloat16"\nload = "first-use"\n')
    got, default = specs("--models", str(file))
    fast, final = got
    assert default == "fast"
    assert (fast.config.options.strategy, fast.config.options.max_batch_size) == ("continuous", 2)
    assert fast.aliases == ("dall-e-2",) and fast.weight == 3.0 and fast.eager
    assert final.config.dtype == "bfloat16" and not final.eager and final.config.options.strategy == "slo"


@pytest.mark.parametrize("text,says", [
    ('[models.a]\npath = "embedded"\nsize = 3\n', "unknown setting(s) size; allowed:"),
    ('[models.a]\ndtype = "float32"\n', "models.a has no path"),
    ('[models.a]\npath = "embedded"\nload = "later"\n', "must be 'start' or 'first-use'"),
    ('[models.a]\npath = "embedded"\nweight = -1\n', "weight must be a positive number"),
    ('models = 3\n', "a [models.NAME] table per model"),
    ('[models.a\n', "not valid TOML"),
    ('[models.a]\npath = "embedded"\ndtype = "float99"\n', "model a: dtype: 'float99' is not allowed; allowed:"),
    ('[models.a]\npath = "embedded"\nmax-batch-size = 0\n', "model a: max-batch-size:"),
    ('[models.a]\npath = "embedded"\nquantize-text = "yes"\n', "must be true or false"),
])
def test_a_bad_models_file_is_one_line(tmp_path, text, says):
    file = tmp_path / "models.toml"
    file.write_text(text)
    with pytest.raises(StartupError) as caught:
        specs("--models", str(file))
    assert says in str(caught.value)


@pytest.mark.parametrize("flags,says", [
    (("--model", "a=embedded", "--model", "a=embedded"), "two models are named 'a'"),
    (("--model", "a=embedded", "--default-model", "b"), "--default-model 'b' is not one of the models served"),
    (("--model", "a=embedded", "--model", "b=embedded", "--ulysses-degree", "2"), "one model per server"),
    (("--models-dir", "/nonexistent-folder"), "not a folder"),
])
def test_bad_model_flags_are_one_line(flags, says):
    from stepserve.commands.serve_models import build_front, models_config

    with pytest.raises(StartupError, match=None) as caught:
        args = parse(*flags)
        build_front(args, models_config(args, serve_settings, check_model, build_parser()), serve_settings)
    assert says in str(caught.value)


def test_a_models_dir_loads_each_model_on_its_first_request(tiny_sd_path, tmp_path):
    import shutil

    for name in ("one", "two"):
        shutil.copytree(tiny_sd_path, tmp_path / name)
    with front_of("--models-dir", str(tmp_path), "--strategy", "continuous") as (server, front):
        with httpx.Client(base_url=server.url, timeout=300) as client:
            before = {m["id"]: m["place"] for m in client.get("/v1/models").json()["data"]}
            answer = client.post("/v1/images/generations", json={"model": "two", "prompt": "x",
                                                                  "num_inference_steps": 2})
            after = {m["id"]: (m["place"], m["loads"]) for m in client.get("/v1/models").json()["data"]}
    assert before == {"one": "disk", "two": "disk"}
    assert answer.status_code == 200, answer.text
    assert after == {"one": ("disk", 0), "two": ("device", 1)}
