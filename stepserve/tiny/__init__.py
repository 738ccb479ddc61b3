"""Tiny random pipelines built offline, one module per model family: `stepserve.tiny.<family>.build_tiny_<family>(
path, seed=0, **options) -> Path` writes a complete diffusers folder (model_index.json, configs, random weights,
tokenizers) in seconds, for tests and benchmarks. Nothing is downloaded."""

from __future__ import annotations

import string

FAMILY_MODULES = ("sd", "sdxl", "sd3", "flux")  # probed by benchmarks/families.py; a missing module is skipped


def clip_tokenizer(max_length: int = 77, pad_token: str | None = None):
    """A CLIP tokenizer over single printable characters (one token per character), built offline. `pad_token`:
    the padding token when it differs from <|endoftext|> (SDXL's second tokenizer pads with "!")."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in (c for c in string.printable if not c.isspace()):
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    extra = {} if pad_token is None else {"pad_token": pad_token}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length, **extra)
