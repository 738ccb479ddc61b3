"""The networks seam (stepserve.backends.Networks) as BLS calls to the classic layout's three network models, so
the classic pipeline model reuses stepserve's executor and samplers and its images equal stepserve's."""

from __future__ import annotations

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch import Tensor


class BlsNetworks:
    """Each method sends its rows in chunks of at most `max_batch_size` (the network models' max_batch_size)."""

    def __init__(self, max_batch_size: int, text_inputs: frozenset[str]) -> None:
        self.max_batch_size = max_batch_size
        self.text_inputs = text_inputs

    def _call(self, model: str, inputs: dict[str, np.ndarray], output: str) -> Tensor:
        rows = len(next(iter(inputs.values())))
        parts = []
        for start in range(0, rows, self.max_batch_size):
            tensors = [pb_utils.Tensor(name, np.ascontiguousarray(a[start:start + self.max_batch_size]))
                       for name, a in inputs.items()]
            response = pb_utils.InferenceRequest(model_name=model, requested_output_names=[output],
                                                 inputs=tensors).exec()
            if response.has_error():
                raise RuntimeError(f"model {model!r}: {response.error().message()}")
            parts.append(pb_utils.get_output_tensor_by_name(response, output).as_numpy())
        return torch.from_numpy(np.concatenate(parts))

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        inputs = {"input_ids": input_ids.cpu().numpy().astype(np.int64)}
        if "attention_mask" in self.text_inputs:
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            inputs["attention_mask"] = mask.cpu().numpy().astype(np.int64)
        return self._call("text_encoder", inputs, "last_hidden_state")

    def denoise(self, sample: Tensor, timestep: Tensor, encoder_hidden_states: Tensor) -> Tensor:
        return self._call("unet", {"sample": sample.cpu().numpy().astype(np.float32),
                                   "timestep": timestep.cpu().numpy().astype(np.float32).reshape(-1, 1),
                                   "encoder_hidden_states": encoder_hidden_states.cpu().numpy().astype(np.float32)},
                          "out_sample")

    def decode(self, latents: Tensor) -> Tensor:
        return self._call("vae_decoder", {"latent_sample": latents.cpu().numpy().astype(np.float32)}, "sample")
