"""The embedded model's digit vocabulary: what it was trained on and what the demo, bench and grid ask it for."""

from __future__ import annotations

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIGIT_PROMPTS = tuple(f"a handwritten {w}" for w in DIGIT_WORDS)  # DIGIT_PROMPTS[d] asks for digit d
