"""A latency model: how long the engine's stages take, predicted from measured points.

The `slo` policy plans with it (admission, the adaptive batch cap, giving up on hopeless requests); the simulator's
fake executor (stepserve.costs.fake) charges the same costs in simulation. Pure data and arithmetic: no torch, no clock.

Rules:
- A curve maps a count (batch size, or number of prompts / images) to seconds through measured points, linearly
  between them and linearly past the first and last (the nearest segment extended; never below 0 s). A curve of
  a single point is taken as proportional to the count (no batching gain is assumed). A count of 0 costs 0 s.
- A denoising step is measured per shape bucket ((height, width); (frames, height, width) for a video model), as
  the model was run: guidance rows included (a request with classifier-free guidance is two rows of the forward
  pass, and the points say what was run).
- A bucket that was not measured costs what the measured bucket nearest in pixel count costs, scaled by the ratio
  of pixel counts (buckets.bucket_pixels: a video bucket counts every frame). Decoding works the same way; text
  encoding does not depend on the image size.
- Files are JSON with a format name and version; free-form metadata (device, dtype, library versions, spread of
  the measurements) travels with the numbers.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..request.buckets import Bucket, bucket_pixels, is_bucket

_BUCKET_SHAPE = "(height, width) or (frames, height, width) in positive integers"

FORMAT_NAME = "stepserve-latency-model"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Curve:
    """Seconds as a piecewise-linear function of a count, through `points` ((count, seconds), counts increasing)."""

    points: tuple[tuple[int, float], ...]
    _counts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        points = tuple((n, float(s)) for n, s in self.points)
        problem = _points_problem(points)
        if problem:
            raise ValueError(problem)
        object.__setattr__(self, "points", points)
        object.__setattr__(self, "_counts", tuple(n for n, _ in points))

    def __call__(self, n: int) -> float:
        if n <= 0:
            return 0.0
        pts = self.points
        if len(pts) == 1:
            n0, s0 = pts[0]
            return s0 * n / n0
        # the segment that contains n, or the first / last one extended
        j = min(max(bisect.bisect_right(self._counts, n) - 1, 0), len(pts) - 2)
        (n0, s0), (n1, s1) = pts[j], pts[j + 1]
        return max(s0 + (s1 - s0) * (n - n0) / (n1 - n0), 0.0)


def _points_problem(points: Sequence[Any]) -> str | None:
    """Why `points` is not a valid curve, or None."""
    if not points:
        return "needs at least one measured point"
    last = 0
    for p in points:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            return f"each point must be a pair [count, seconds], got {p!r}"
        n, s = p
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return f"counts must be integers >= 1, got {n!r}"
        if n <= last:
            return f"counts must be strictly increasing, got {n} after {last}"
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) or s < 0:
            return f"seconds must be finite numbers >= 0, got {s!r} at count {n}"
        last = n
    return None


@dataclass(frozen=True)
class LatencyModel:
    """Predicted seconds for one denoising step, text encoding and decoding; see the module docstring for rules.

    `step` and `decode` map measured buckets to curves over the batch size; `encode` is a curve over the number
    of prompts encoded together. `reference_bucket` is the bucket meant when none is given (default: the first
    measured one). The mappings are not meant to be changed after construction.
    """

    step: Mapping[Bucket, Curve]
    encode: Curve
    decode: Mapping[Bucket, Curve]
    reference_bucket: Bucket | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.step:
            raise ValueError("a latency model needs the step cost of at least one bucket")
        if not self.decode:
            raise ValueError("a latency model needs the decode cost of at least one bucket")
        for b in list(self.step) + list(self.decode):
            if not is_bucket(b):
                raise ValueError(f"a bucket is {_BUCKET_SHAPE}, got {b!r}")
        ref = self.reference_bucket if self.reference_bucket is not None else next(iter(self.step))
        if tuple(ref) not in self.step:
            raise ValueError(f"reference_bucket {ref!r} is not one of the measured buckets {list(self.step)}")
        object.__setattr__(self, "reference_bucket", tuple(ref))
        object.__setattr__(self, "step", {tuple(b): c for b, c in self.step.items()})
        object.__setattr__(self, "decode", {tuple(b): c for b, c in self.decode.items()})
        object.__setattr__(self, "metadata", dict(self.metadata))
        object.__setattr__(self, "_memo", {})  # (stage, bucket, n) -> seconds: the model never changes

    # --- predictions -------------------------------------------------------------------------------------------
    def step_s(self, batch_size: int, bucket: Bucket | None = None) -> float:
        """One denoising forward of `batch_size` requests of `bucket` (guidance rows as measured)."""
        key = (0, bucket, batch_size)
        try:
            return self._memo[key]
        except KeyError:
            t = self._memo[key] = _at(self.step, tuple(bucket or self.reference_bucket), batch_size)
            return t
        except TypeError:  # a bucket given as a list: not kept
            return _at(self.step, tuple(bucket), batch_size)

    def encode_s(self, n: int) -> float:
        """Encoding the prompts of `n` requests admitted together."""
        key = (2, None, n)
        try:
            return self._memo[key]
        except KeyError:
            t = self._memo[key] = self.encode(n)
            return t

    def decode_s(self, n: int, bucket: Bucket | None = None) -> float:
        """Decoding `n` finished images of `bucket` together."""
        key = (1, bucket, n)
        try:
            return self._memo[key]
        except KeyError:
            t = self._memo[key] = _at(self.decode, tuple(bucket or self.reference_bucket), n)
            return t
        except TypeError:  # a bucket given as a list: not kept
            return _at(self.decode, tuple(bucket), n)

    # --- construction ------------------------------------------------------------------------------------------
    @classmethod
    def zero(cls) -> "LatencyModel":
        """Every stage free. A policy planning with it never predicts a miss: it orders, but never refuses a
        request or gives up on one before its deadline actually passes."""
        zero = Curve(((1, 0.0),))
        return cls(step={(1, 1): zero}, encode=zero, decode={(1, 1): zero}, metadata={"source": "zero"})

    @classmethod
    def from_cost_model(cls, cost: Any, buckets: Iterable[Bucket] = ((32, 32),), guidance: bool = True,
                        reference_bucket: Bucket | None = None) -> "LatencyModel":
        """The costs of the fake executor's CostModel (stepserve.costs.cost_model), exactly, for `buckets`.

        The cost model is linear in the batch size, so two points per curve reproduce it at every batch size.
        `guidance`: whether each request is counted as two rows of the forward (as requests with guidance_scale > 1
        are); requests without guidance then cost less than predicted.
        """
        rows = 2 if guidance else 1
        buckets = [tuple(b) for b in buckets]
        step, decode = {}, {}
        for b in buckets:
            scale = bucket_pixels(b) / cost.reference_pixels
            step[b] = Curve(tuple((n, cost.step_fixed_s + cost.step_per_item_s * rows * n * scale)
                                  for n in (1, 2)))
            decode[b] = Curve(tuple((n, cost.decode_fixed_s + cost.decode_per_item_s * n * scale)
                                         for n in (1, 2)))
        encode = Curve(tuple((n, cost.encode_fixed_s + cost.encode_per_item_s * n) for n in (1, 2)))
        return cls(step=step, encode=encode, decode=decode, reference_bucket=reference_bucket,
                   metadata={"source": "stepserve.costs.CostModel", "guidance_rows": rows})

    # --- files -------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def curves(m: Mapping[Bucket, Curve]) -> list[dict[str, Any]]:
            return [{"bucket": list(b), "points": [list(p) for p in c.points]} for b, c in m.items()]

        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "reference_bucket": list(self.reference_bucket),
            "step": curves(self.step),
            "encode": [list(p) for p in self.encode.points],
            "decode": curves(self.decode),
            "metadata": dict(self.metadata),
        }

    def to_json(self, indent: int | None = 2) -> str:
        try:
            return json.dumps(self.to_dict(), indent=indent)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"latency model metadata must be plain JSON data: {exc}") from exc

    @classmethod
    def from_dict(cls, data: Any, source: str = "latency model") -> "LatencyModel":
        """Read what to_dict() wrote; a ValueError names `source` and what is wrong."""

        def bad(what: str) -> ValueError:
            return ValueError(f"{source}: {what}")

        if not isinstance(data, dict):
            raise bad(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT_NAME:
            raise bad(f"not a stepserve latency model (format is {data.get('format')!r}, expected {FORMAT_NAME!r})")
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise bad(f"format version {version!r} is not supported (this stepserve reads version {FORMAT_VERSION})")
        for key in ("step", "encode", "decode"):
            if key not in data:
                raise bad(f"missing field {key!r}")

        def curve(points: Any, where: str) -> Curve:
            if not isinstance(points, list):
                raise bad(f"{where}: expected a list of [count, seconds] points, got {type(points).__name__}")
            problem = _points_problem(points)
            if problem:
                raise bad(f"{where}: {problem}")
            return Curve(tuple(tuple(p) for p in points))

        def per_bucket(key: str) -> dict[Bucket, Curve]:
            entries = data[key]
            if not isinstance(entries, list) or not entries:
                raise bad(f"{key}: expected a non-empty list of {{'bucket': [height, width] (video: [frames, "
                          f"height, width]), 'points': [...]}}")
            out: dict[Bucket, Curve] = {}
            for i, e in enumerate(entries):
                where = f"{key}[{i}]"
                if not isinstance(e, dict) or "bucket" not in e or "points" not in e:
                    raise bad(f"{where}: expected an object with 'bucket' and 'points'")
                if not is_bucket(e["bucket"]):
                    raise bad(f"{where}.bucket: expected [height, width] (video: [frames, height, width]) in "
                              f"positive integers, got {e['bucket']!r}")
                b = tuple(e["bucket"])
                if b in out:
                    raise bad(f"{where}.bucket: {list(b)} is listed twice")
                out[b] = curve(e["points"], f"{where}.points")
            return out

        step = per_bucket("step")
        decode = per_bucket("decode")
        encode = curve(data["encode"], "encode")
        ref = data.get("reference_bucket")
        if ref is not None:
            if not is_bucket(ref) or tuple(ref) not in step:
                raise bad(f"reference_bucket {ref!r} is not one of the buckets in 'step'")
            ref = tuple(ref)
        metadata = data.get("metadata", {})
        if not isinstance(metadata, dict):
            raise bad(f"metadata: expected a JSON object, got {type(metadata).__name__}")
        return cls(step=step, encode=encode, decode=decode, reference_bucket=ref, metadata=metadata)

    @classmethod
    def from_json(cls, text: str, source: str = "latency model") -> "LatencyModel":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "LatencyModel":
        """Read a file written by save(); a missing, unreadable or malformed file raises ValueError saying which."""
        source = f"latency model file {str(path)!r}"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{source}: cannot be read ({exc})") from exc
        return cls.from_json(text, source)


def _at(curves: Mapping[Bucket, Curve], bucket: Bucket, n: int) -> float:
    """A measured bucket's curve at n, or the curve of the measured bucket nearest in pixels (bucket_pixels: frames
    counted), scaled by pixels."""
    curve = curves.get(bucket)
    if curve is not None:
        return curve(n)
    pixels = bucket_pixels(bucket)
    # nearest pixel count; on a tie the larger bucket (the more conservative prediction)
    near = min(curves, key=lambda b: (abs(bucket_pixels(b) - pixels), -bucket_pixels(b)))
    return curves[near](n) * pixels / bucket_pixels(near)
