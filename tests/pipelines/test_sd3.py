"""Stable Diffusion 3: served images equal diffusers' own StableDiffusion3Pipeline run alone per request with the
same seed, under every strategy and any batch company; the text rules (CLIP 77, T5 256, no T5) as diffusers has
them."""

import pytest
import torch

from stepserve.tiny.sd3 import build_tiny_sd3

LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # ~350 characters: past CLIP's 77 and T5's 256 tokens


@pytest.fixture(scope="module")
def sd3_path(tmp_path_factory):
    return build_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


@pytest.fixture(scope="module")
def sd3_no_t5_path(tmp_path_factory):
    return build_tiny_sd3(tmp_path_factory.mktemp("sd3_no_t5") / "pipe", with_t5=False, seed=1)


_PIPES: dict = {}


def diffusers_pipeline(path):
    from diffusers import StableDiffusion3Pipeline

    if str(path) not in _PIPES:
        index = (path / "model_index.json").read_text()
        no_t5 = '"text_encoder_3": [\n    null' in index
        # diffusers loads a folder without T5 only when told so (text_encoder_3=None), then feeds zeros for it
        kwargs = {"text_encoder_3": None, "tokenizer_3": None} if no_t5 else {}
        pipe = StableDiffusion3Pipeline.from_pretrained(path, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[str(path)] = pipe
    return _PIPES[str(path)]


def test_text_conditioning_equals_encode_prompt(sd3_path, sd3_no_t5_path):
    from stepserve.pipelines.sd3 import SD3Adapter

    for path in (sd3_path, sd3_no_t5_path):
        pipe, adapter = diffusers_pipeline(path), SD3Adapter.from_pretrained(path)
        prompts = ["a cat", LONG_PROMPT, ""]
        ours = adapter.encode_prompts(prompts)
        for prompt, cond in zip(prompts, ours):
            embeds, _, pooled, _ = pipe.encode_prompt(prompt, None, None, do_classifier_free_guidance=False)
            assert cond.embeds.shape == embeds[0].shape == (77 + 256, 128)
            torch.testing.assert_close(cond.embeds, embeds[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cond.pooled, pooled[0], atol=1e-5, rtol=1e-5)
        if path == sd3_no_t5_path:
            assert not adapter.has_t5 and not ours[0].embeds[77:].any()
        else:
            assert adapter.has_t5 and ours[0].embeds[77:].abs().sum() > 0


def test_clip_truncates_at_77_and_t5_reads_on(sd3_path, sd3_no_t5_path):
    """Two prompts that agree on CLIP's first 77 tokens: only T5 can tell them apart."""
    from stepserve.pipelines.sd3 import SD3Adapter

    a, b = LONG_PROMPT[:150] + " red", LONG_PROMPT[:150] + " blue"
    with_t5 = SD3Adapter.from_pretrained(sd3_path).encode_prompts([a, b])
    torch.testing.assert_close(with_t5[0].pooled, with_t5[1].pooled)
    torch.testing.assert_close(with_t5[0].embeds[:77], with_t5[1].embeds[:77])
    assert (with_t5[0].embeds[77:] - with_t5[1].embeds[77:]).abs().max() > 1e-3
    no_t5 = SD3Adapter.from_pretrained(sd3_no_t5_path).encode_prompts([a, b])
    torch.testing.assert_close(no_t5[0].embeds, no_t5[1].embeds)
