"""Data for the embedded model: scikit-learn's 8x8 digits, upscaled, plus digit prompts and a tiny tokenizer.

Everything here is offline: ``sklearn.datasets.load_digits`` ships inside scikit-learn.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..util.digits import DIGIT_WORDS

# "{d}" is the numeral, "{w}" the word. The empty prompt (classifier-free guidance) is added by the sampler below.
PROMPT_TEMPLATES = (
    "{d}",
    "{w}",
    "a handwritten {w}",
    "a handwritten {d}",
    "the digit {d}",
    "the digit {w}",
    "digit {d}",
    "number {w}",
    "the number {d}",
    "a {w}",
    "handwritten digit {w}",
    "an image of the digit {d}",
    "a drawing of a {w}",
    "a picture of the number {w}",
)

# Words that get a single token each (the tokenizer falls back to characters for anything else).
WORD_TOKENS = DIGIT_WORDS + (
    "a", "an", "the", "digit", "digits", "number", "numeral", "handwritten", "hand", "written", "image",
    "of", "drawing", "picture", "photo", "white", "black", "on", "small", "big", "blurry",
)

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def load_digit_images(size: int = 32) -> tuple[torch.Tensor, np.ndarray]:
    """All 1,797 digits as (N, 3, size, size) float tensors in [-1, 1] (grey replicated), plus labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy(digits.images.astype(np.float32))[:, None] / 8.0 - 1.0  # 0..16 -> -1..1
    x = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False).clamp(-1.0, 1.0)
    return x.repeat(1, 3, 1, 1).contiguous(), digits.target.astype(np.int64)


def augment(x: torch.Tensor, gen: torch.Generator, max_shift: float = 1.0, max_rot_deg: float = 6.0,
            scale_range: float = 0.06) -> torch.Tensor:
    """Light random affine jitter (shift in pixels, rotation, isotropic scale); background stays at -1."""
    n, _, h, _ = x.shape
    u = torch.rand(n, 4, generator=gen) * 2 - 1
    ang = u[:, 0] * max_rot_deg * np.pi / 180
    sc = 1 + u[:, 1] * scale_range
    tx, ty = u[:, 2] * max_shift * 2 / h, u[:, 3] * max_shift * 2 / h
    cos, sin = torch.cos(ang) / sc, torch.sin(ang) / sc
    theta = torch.stack([torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x + 1, grid, mode="bilinear", padding_mode="zeros", align_corners=False) - 1
    return out.clamp(-1.0, 1.0)


def sample_prompts(labels: list[int] | np.ndarray, rng: random.Random, p_empty: float = 0.12) -> list[str]:
    """One random phrasing per label; a fraction ``p_empty`` become "" (trains the unconditional branch)."""
    out = []
    for d in labels:
        if rng.random() < p_empty:
            out.append("")
            continue
        t = rng.choice(PROMPT_TEMPLATES).format(d=int(d), w=DIGIT_WORDS[int(d)])
        if rng.random() < 0.15:
            t = t.capitalize()
        out.append(t)
    return out


def _byte_chars() -> list[str]:
    """The 256 printable stand-ins for raw bytes used by byte-level BPE (printable bytes map to themselves)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_vocab_and_merges(words=WORD_TOKENS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab (256 chars + 256 word-final chars) plus left-to-right merges that make each word one token."""
    chars = _byte_chars()
    vocab: dict[str, int] = {}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    seen = set()
    for w in words:
        parts = list(w[:-1]) + [w[-1] + "</w>"]
        while len(parts) > 1:
            pair = (parts[0], parts[1])
            parts = [parts[0] + parts[1]] + parts[2:]
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
            if parts[0] not in vocab:
                vocab[parts[0]] = len(vocab)
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    return vocab, merges


def build_tokenizer(max_length: int = 16):
    """A CLIPTokenizer over the vocab above (lower-cases, so "Seven" and "seven" agree)."""
    from transformers import CLIPTokenizer

    vocab, merges = build_vocab_and_merges()
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length, bos_token=BOS, eos_token=EOS,
                         pad_token=EOS, unk_token=EOS)


def save_tokenizer(tok, out_dir: str | Path) -> None:
    """save_pretrained plus vocab.json / merges.txt, so both tokenizer back ends can reload the folder."""
    out_dir = Path(out_dir)
    tok.save_pretrained(out_dir)
    vocab, merges = build_vocab_and_merges()
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
