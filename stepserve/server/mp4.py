"""MP4 files of a video's frames, encoded with imageio-ffmpeg (the `video` package extra: it bundles an ffmpeg
binary). H.264 in yuv420p, the format every browser and player takes."""

from __future__ import annotations

import os
import tempfile

import numpy as np

EXTRA = "video"


class EncoderMissing(RuntimeError):
    """imageio-ffmpeg is not installed."""


def check_encoder() -> None:
    """Raise EncoderMissing, saying what to install, when MP4s cannot be made here."""
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        raise EncoderMissing(f"MP4 encoding needs imageio-ffmpeg: pip install 'stepserve[{EXTRA}]'") from None


def encode_mp4(frames: list, fps: int) -> bytes:
    """The frames (PIL images of one size) as an MP4 at `fps` frames per second."""
    check_encoder()
    import imageio_ffmpeg

    width, height = frames[0].size
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        # macro_block_size 2: yuv420p needs even sides, and a size the model made must not be resized
        writer = imageio_ffmpeg.write_frames(path, (width, height), fps=fps, codec="libx264", pix_fmt_out="yuv420p",
                                             macro_block_size=2, quality=8, ffmpeg_log_level="error")
        writer.send(None)  # start the encoder
        for frame in frames:
            writer.send(np.ascontiguousarray(np.asarray(frame.convert("RGB"), dtype=np.uint8)))
        writer.close()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)
