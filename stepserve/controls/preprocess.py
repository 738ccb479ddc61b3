"""Control maps made from photos on the server (`"preprocess": "canny"` in a control): users send photos, a
ControlNet wants a map. Canny edges need no model; depth or pose annotators do, so their maps come from the client.

Canny (J. Canny, "A Computational Approach to Edge Detection", IEEE TPAMI 1986) through OpenCV's `cv2.Canny` on
the image's grayscale, with hysteresis thresholds 100 and 200 (diffusers' and ControlNet's own canny examples use
these), edges white on black, as three RGB channels. OpenCV is an optional extra: `pip install 'stepserve[canny]'`.
"""

from __future__ import annotations

from typing import Any

PREPROCESSORS = ("canny",)
CANNY_LOW, CANNY_HIGH = 100, 200


class PreprocessUnavailable(ImportError):
    """The preprocessor's library is not installed on this server."""


def available(name: str) -> None:
    """Raises PreprocessUnavailable when `name`'s library is missing (before any image is decoded)."""
    try:
        import cv2  # noqa: F401
    except ImportError:
        raise PreprocessUnavailable(f"preprocess {name!r} needs OpenCV, which this server lacks (pip install "
                                    "'stepserve[canny]')") from None


def canny(image: Any) -> Any:
    """The Canny edge map of an RGB PIL image, as an RGB PIL image of the same size."""
    import cv2
    import numpy as np
    from PIL import Image

    gray = cv2.cvtColor(np.asarray(image.convert("RGB")), cv2.COLOR_RGB2GRAY)
    edges = cv2.Canny(gray, CANNY_LOW, CANNY_HIGH)
    return Image.fromarray(np.stack([edges] * 3, axis=-1))


def apply(name: str, image: Any) -> Any:
    return {"canny": canny}[name](image)
