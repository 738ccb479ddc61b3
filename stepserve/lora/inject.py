"""Reading an adapter file and injecting it into the live modules, as the family's diffusers LoRA loader does
(through PEFT), under a module-safe key: torch's ModuleDict refuses some names ('.'), so each adapter is known to
the modules by a key of its own (`key_for`) and to users by its name (store.py keeps the two apart)."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path

from .errors import LoraError, LoraUnsupportedError

PEFT_MISSING = "LoRA adapters need the peft package: install stepserve[lora]"


def key_for(name: str, serial: int) -> str:
    """A key no two loads share and ModuleDict accepts (the user's name kept readable in it)."""
    return f"a{serial}_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"


def require_peft() -> None:
    try:
        importlib.import_module("peft")
    except ImportError:
        raise LoraUnsupportedError(PEFT_MISSING) from None


class Injector:
    """The denoiser (and text encoders) of one pipeline, and its family's diffusers loader mixin."""

    def __init__(self, pipeline) -> None:
        spec = getattr(pipeline, "lora_loader", None)
        self.module = getattr(pipeline.networks, spec[1], None) if spec else None
        if self.module is None:
            raise LoraUnsupportedError(f"{pipeline.info.family} on this backend serves no LoRA adapters (torch "
                                       f"backend only, families: sd, sdxl, sd3, flux, flux2, qwenimage)")
        mixin_path, self.module_name = spec
        self.networks = pipeline.networks
        module, _, cls = mixin_path.partition(":")
        self.mixin = getattr(importlib.import_module(module), cls)

    def read(self, file: Path) -> tuple[dict, dict | None, dict | None]:
        """(state dict in diffusers' naming, network alphas, adapter metadata) as the family's loader reads them."""
        params = inspect.signature(self.mixin.lora_state_dict).parameters
        kwargs = {"return_lora_metadata": True}
        if "return_alphas" in params:
            kwargs["return_alphas"] = True
        out = self.mixin.lora_state_dict(str(file), **kwargs)
        out = out if isinstance(out, tuple) else (out,)
        return out[0], (out[1] if len(out) > 2 else None), (out[-1] if len(out) > 1 else None)

    def unknown_parts(self, state_dict: dict) -> list[str]:
        """The modules `state_dict` adapts that this model does not have."""
        return sorted({k.split(".", 1)[0] for k in state_dict} - {self.module_name}
                      - {p for p, _ in self.text_encoders(state_dict)})

    def estimate_bytes(self, state_dict: dict) -> int:
        """The device memory the adapter's weights will take (the modules' dtype), before it is injected."""
        size = next(self.module.parameters()).element_size()
        return sum(v.numel() for v in state_dict.values() if hasattr(v, "numel")) * size

    def text_encoders(self, state_dict: dict | None) -> list[tuple[str, object]]:
        """(prefix, module) of the text encoders (those `state_dict` adapts, when given) this model has."""
        out = []
        for prefix in ("text_encoder", "text_encoder_2"):
            module = getattr(self.networks, prefix, None)
            if module is not None and (state_dict is None or any(k.startswith(prefix + ".") for k in state_dict)):
                out.append((prefix, module))
        return out

    def modules(self) -> list:
        """The denoiser and the text encoders adapters may adapt."""
        return [self.module] + [m for _, m in self.text_encoders(None)]

    def layers(self, key: str) -> list:
        return [m for module in self.modules() for m in module.modules() if hasattr(m, "lora_A") and key in m.lora_A]

    def inject(self, state_dict: dict, alphas: dict | None, metadata: dict | None, key: str) -> None:
        """The family's `load_lora_into_unet` / `load_lora_into_transformer` on the live denoiser, and its
        `load_lora_into_text_encoder` on each text encoder the file adapts (as its load_lora_weights calls them)."""
        encoders = self.text_encoders(state_dict)
        denoiser = {k: v for k, v in state_dict.items() if not any(k.startswith(p + ".") for p, _ in encoders)}
        with warnings.catch_warnings():  # PEFT warns that a model holds several adapters: that is the point
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            self._call(f"load_lora_into_{self.module_name}", denoiser, alphas, metadata, key,
                       **{self.module_name: self.module})
            for prefix, module in encoders:
                self._call("load_lora_into_text_encoder", state_dict, alphas, metadata, key, text_encoder=module,
                           prefix=prefix)
        for module in [m for _, m in encoders]:  # transformers' models: switch PEFT's application off per layer
            for layer in module.modules():
                if hasattr(layer, "lora_A") and key in layer.lora_A:
                    layer.enable_adapters(False)

    def forget(self, key: str) -> None:
        with warnings.catch_warnings():  # PEFT warns that the adapter it deletes was "active": ours never are
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self._forget(key)

    def _forget(self, key: str) -> None:
        for module in self.modules():
            if any(hasattr(m, "lora_A") and key in m.lora_A for m in module.modules()):
                if hasattr(module, "delete_adapters"):
                    module.delete_adapters(key)
                else:  # a transformers text encoder: PEFT's layers, and its peft_config (so the key loads again)
                    from peft.tuners.tuners_utils import BaseTunerLayer

                    for m in module.modules():
                        if isinstance(m, BaseTunerLayer) and key in m.lora_A:
                            m.delete_adapter(key)
                    (getattr(module, "peft_config", None) or {}).pop(key, None)

    def _call(self, method_name: str, state_dict: dict, alphas, metadata, key: str, **modules) -> None:
        method = getattr(self.mixin, method_name)
        params = inspect.signature(method).parameters
        kwargs = {**modules, "adapter_name": key}
        for k, value in (("network_alphas", alphas), ("metadata", metadata), ("_pipeline", None)):
            if k in params:
                kwargs[k] = value
        method(dict(state_dict), **kwargs)


def check_served(layers: list, key: str, name: str, file_name: str) -> None:
    """LoraError unless every layer is a plain LoRA layer (no DoRA, no bias on lora_B)."""
    if any((getattr(layer, "use_dora", {}) or {}).get(key) or getattr(layer.lora_B[key], "bias", None) is not None
           for layer in layers):
        raise LoraError(f"adapter {name!r}: {file_name} uses DoRA or a bias on lora_B, which are not served (plain "
                        f"LoRA only)")
