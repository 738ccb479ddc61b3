"""Per-row scales are not rounded to the rows' dtype: in bfloat16, 0.7 as a bfloat16 is 0.69921875. diffusers and
peft multiply by the Python float (each product rounded once), so a ControlNet's weighted outputs, an IP-Adapter's
scaled image attention values and a LoRA's per-row delta equal `tensor * 0.7` of the same bfloat16 tensor, row by
row, beside rows of other scales."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stepserve.controls.rows import _weighted
from stepserve.ipadapter import rows as ip_rows

SCALES = (0.7, 0.3, 1.3)
BF16 = torch.bfloat16


def outputs(seed: int, shape=(3, 4, 5, 5)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def test_bfloat16_rounds_the_scale():  # what the tests below would miss were the table bfloat16
    r = outputs(0)
    assert not torch.equal(r * torch.tensor(0.7, dtype=BF16), r * 0.7)


@pytest.mark.parametrize("guess", [False, True])
def test_controlnet_outputs_weighted_as_diffusers_does(guess):
    flat = [outputs(1), outputs(2)]
    factors = [0.1, 1.0]  # a guess-mode logspace's ends
    pipeline = SimpleNamespace(guess_scales=lambda net, count: factors[:count])
    used = [(i, s, None, guess) for i, s in enumerate(SCALES)]
    got = _weighted(pipeline, None, flat, used, 2)
    for b, (r, out) in enumerate(zip(flat, got)):
        assert out.dtype is BF16
        for i, s in enumerate(SCALES):
            scale = s * factors[b] if guess else s
            assert torch.equal(out[i], r[i] * scale), (b, i)


def test_ip_adapter_rows_scaled_as_diffusers_does():
    linear = torch.nn.Linear(8, 6).to(BF16)
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(3)).to(BF16)
    ip_rows._state.scales = {"face": torch.tensor(SCALES, dtype=torch.float32)}
    try:
        with torch.inference_mode():
            got = ip_rows.RowScaled(linear, "face")(x)
            plain = linear(x)
    finally:
        ip_rows._state.scales = None
    assert got.dtype is BF16
    for i, s in enumerate(SCALES):
        assert torch.equal(got[i], plain[i] * s), i


def test_lora_rows_scaled_as_peft_does():
    peft = pytest.importorskip("peft")
    from stepserve.lora import rows as lora_rows

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6))
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=2, lora_alpha=2, target_modules=["0"]), model, "a")
    layer = model[0]
    torch.nn.init.normal_(layer.lora_B["a"].weight)
    model.to(BF16)
    layer.enable_adapters(False)
    layer.register_forward_hook(lora_rows.hook)
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(5)).to(BF16)
    with torch.inference_mode():
        with lora_rows.adapter_rows([(("a", s),) for s in SCALES]):
            got = model(x)
        base = layer.base_layer(x)
        delta = layer.lora_B["a"](layer.lora_A["a"](x))
    assert got.dtype is BF16
    for i, s in enumerate(SCALES):
        assert torch.equal(got[i], base[i] + delta[i] * (layer.scaling["a"] * s)), i


def test_lora_rows_of_different_adapters_scaled_as_peft_does():
    """Rows of different adapters at one position take the gathered path (one batched matmul pair)."""
    peft = pytest.importorskip("peft")
    from stepserve.lora import rows as lora_rows

    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6))
    for name in ("a", "b"):
        model = peft.inject_adapter_in_model(peft.LoraConfig(r=2, lora_alpha=2, target_modules=["0"]), model, name)
    layer = model[0]
    for name in ("a", "b"):
        torch.nn.init.normal_(layer.lora_B[name].weight)
    model.to(BF16)
    layer.enable_adapters(False)
    layer.register_forward_hook(lora_rows.hook)
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(7)).to(BF16)
    names = ("a", "b", "a")
    with torch.inference_mode():
        with lora_rows.adapter_rows([((n, s),) for n, s in zip(names, SCALES)]):
            got = model(x)
        base = layer.base_layer(x)
        for i, (n, s) in enumerate(zip(names, SCALES)):
            A, B = layer.lora_A[n].weight, layer.lora_B[n].weight
            xa = torch.bmm(x[i:i + 1], A.t()[None])
            want = base[i] + (torch.bmm(xa, B.t()[None]) * (layer.scaling[n] * s))[0]
            assert torch.equal(got[i], want), i
