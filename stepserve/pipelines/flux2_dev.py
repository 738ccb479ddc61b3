"""Flux.2 [dev] (diffusers `Flux2Pipeline`): the Flux.2 transformer, VAE, latents, position ids, schedule and
decode of flux2.py, with what [dev] changes, each as diffusers 0.42's `Flux2Pipeline` does it:

- text (`_get_mistral_3_small_prompt_embeds`): a `Mistral3ForConditionalGeneration` (used as a text model: no
  image input) behind the folder's tokenizer, a `PixtralProcessor` in the published folders. The prompt, with
  every "[IMG]" removed (`format_input`: the processor counts image tokens and would fail on one that truncation
  cut), goes in as a chat: the pipeline's system message, then the prompt as a user message, each content a list
  of text parts; `apply_chat_template(add_generation_prompt=False, tokenize=True)` padded and truncated to
  `max_sequence_length` (512). The hidden states of layers 10, 20 and 30 (`text_encoder_out_layers`) are stacked
  per token, (L, 3 x width). No pooled output.
- guidance: embedded. The transformer takes the guidance value (`torch.full([1], guidance_scale)`, float32) in
  each request's own row; there is no unconditional row, no negative prompt, and guidance_scale 1.0 is a value
  like any other, not "off".
- not served: prompt upsampling (`caption_upsample_temperature`: the text encoder generating a new prompt) and
  reference images (`image`: extra image tokens with their own ids, a different count per request, which does not
  fit one size bucket per forward). Requests have no field for the first; validation refuses an image.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..request.types import SamplingParams
from .family import Conditioning
from .flux2 import Flux2Adapter
from .folder import PipelineFolder

PIPELINE_CLASS = "Flux2Pipeline"
TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline.__call__'s text_encoder_out_layers default


def system_message() -> str:
    """The system message Flux2Pipeline puts before every prompt (diffusers' own text, read from diffusers)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return SYSTEM_MESSAGE


def chat(prompt: str, system: str) -> list[dict]:
    """One conversation as Flux2Pipeline's format_input writes it for a text-only prompt."""
    return [{"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]}]


def tokenizer_class(folder: PipelineFolder) -> type:
    """The class model_index.json names for the folder's `tokenizer`, which is what diffusers loads: a
    PixtralProcessor in the published folders (it needs torchvision; transformers says so when it is missing),
    or a tokenizer whose chat template takes the same messages."""
    import transformers

    entry = folder.index.get("tokenizer")
    found = getattr(transformers, entry[1], None) if isinstance(entry, list) and len(entry) == 2 \
        and entry[0] == "transformers" else None
    if not isinstance(found, type):
        raise ValueError(f"{folder.name}: model_index.json 'tokenizer' is {entry!r}; allowed: [\"transformers\", "
                         "a transformers processor or tokenizer class], e.g. [\"transformers\", \"PixtralProcessor\"]")
    return found


class Flux2DevAdapter(Flux2Adapter):
    """A loaded Flux.2 [dev] pipeline: klein's adapter with the Mistral-3 text encoding and embedded guidance."""

    pipeline_classes = (PIPELINE_CLASS,)
    default_text_layers = TEXT_LAYERS
    guidance_mode = "embedded"
    prompt_cache_size: ClassVar[int] = 32  # a real [dev] prompt is 512 x 15360 values, twice klein's

    def __init__(self, tokenizer, networks, *, system: str | None = None, **kwargs) -> None:
        """Flux2Adapter's arguments; `system`: the system message (default the pipeline's)."""
        super().__init__(tokenizer, networks, **kwargs)
        self.system = system_message() if system is None else system

    @classmethod
    def text_parts(cls, folder: PipelineFolder) -> dict[str, type]:
        from transformers import Mistral3ForConditionalGeneration

        return {"tokenizer": tokenizer_class(folder), "text_encoder": Mistral3ForConditionalGeneration}

    @classmethod
    def check_transformer(cls, name: str, config) -> None:
        """Any Flux.2 transformer: one without a guidance embedding ignores the value, as in the pipeline."""

    def tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), (1, max_sequence_length): the pipeline's chat, tokenized by the template."""
        tokens = self.tokenizer.apply_chat_template(
            [chat(prompt, self.system)], add_generation_prompt=False, tokenize=True, return_dict=True,
            return_tensors="pt", padding="max_length", truncation=True, max_length=self.max_sequence_length)
        return tokens["input_ids"], tokens["attention_mask"]

    def encode(self, params: list[SamplingParams]) -> list[Conditioning]:
        """One row per request: its prompt's embeddings, its token grid and its guidance value (float32, as the
        pipeline's torch.full([1], guidance_scale)); never an unconditional row."""
        out = []
        for p, embeds in zip(params, self.encode_prompts([p.prompt for p in params])):
            if p.negative_prompt:
                raise ValueError(f"negative_prompt: {self.info.name} (flux2 dev) takes no negative prompt; "
                                 "allowed: empty (guidance is embedded, not classifier-free)")
            out.append(Conditioning({
                "encoder_hidden_states": embeds[None], "grid": self.token_grid(p),
                "guidance": torch.full([1], float(p.guidance_scale), device=self.device, dtype=torch.float32)}))
        return out
