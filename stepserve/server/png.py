"""PNG + base64 encoding of response images."""

from __future__ import annotations

import asyncio
import base64
import io


def png_b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


async def encode(image) -> str:
    """Large images are encoded off the event loop so other requests keep flowing."""
    if image.width * image.height <= 128 * 128:
        return png_b64(image)
    return await asyncio.to_thread(png_b64, image)
