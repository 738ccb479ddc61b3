"""Tiny random pipelines built offline, one module per model family: `stepserve.tiny.<family>.build_tiny_<family>(
path, seed=0, **options) -> Path` writes a complete diffusers folder (model_index.json, configs, random weights,
tokenizers) in seconds, for tests and benchmarks. Nothing is downloaded."""

from __future__ import annotations

import string

FAMILY_MODULES = ("sd", "sdxl", "sd3", "flux", "qwenimage", "flux2", "wan")  # probed by benchmarks/families.py; a missing module is skipped


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


CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE writes the bytes 0..255 as (GPT-2's table, which Qwen2 uses)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {b: b for b in kept}, 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = 256 + extra
            extra += 1
    return [chr(symbols[b]) for b in range(256)]


def byte_tokenizer(special: tuple[str, ...], chat_template: str | None = None, **roles: str):
    """A byte-level BPE tokenizer (the Qwen2 tokenizer class, no merges: one token per byte) built offline, with
    `special` tokens after the 256 byte symbols; `roles`: which of them are the unk/bos/eos/pad tokens (the Qwen2
    class's keyword names); `chat_template`: a Jinja chat template for apply_chat_template."""
    from transformers import Qwen2Tokenizer

    vocab = {s: i for i, s in enumerate(byte_symbols())}
    for token in special:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], **roles)
    named = set(tokenizer.all_special_tokens)  # the roles' tokens (the class's defaults included) are special already
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in special if t not in named]})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def qwen_tokenizer(chat_template: str | None = None):
    """A Qwen2 tokenizer (byte-level BPE, no merges: one token per byte) with Qwen's chat tokens, built offline;
    `chat_template`: a Jinja chat template for apply_chat_template."""
    return byte_tokenizer(("<|endoftext|>", *CHAT_TOKENS), chat_template)


# Mistral's control tokens: the chat's system and instruction brackets, and the image tokens a Pixtral processor
# looks up (a tokenizer standing in for one keeps them, though no image is ever sent).
MISTRAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                  "[IMG]", "[IMG_BREAK]", "[IMG_END]")


def mistral_tokenizer(chat_template: str | None = None):
    """A byte-level tokenizer with Mistral's control tokens and roles (<s>, </s>, <pad>, <unk>), built offline."""
    return byte_tokenizer(MISTRAL_TOKENS, chat_template, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                          pad_token="<pad>")
