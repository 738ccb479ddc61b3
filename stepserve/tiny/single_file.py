"""A diffusers folder's denoiser written as one file, as `--transformer FILE` / `--unet FILE` read it: a
.safetensors, or a .gguf whose weight matrices are quantized (Q8_0, Q4_0, or the K-quant Q6_K).

The file keeps diffusers' key names (diffusers reads those as well as the original layouts). The GGUF file is
written with the gguf package's writer. gguf quantizes Q8_0 and Q4_0 itself; it only reads K-quants, so Q6_K is
quantized here, in the layout ggml's `dequantize_row_q6_K` reads (checked against gguf's own dequantizer). A
matrix whose rows are not a whole number of the type's blocks stays float32, as llama.cpp's converters keep
small tensors unquantized.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

GGUF_TYPES = ("Q8_0", "Q4_0", "Q6_K")


def denoiser_state(model: str | Path, part: str) -> dict:
    """The float32 state dict of `model`'s sub-folder `part` (its safetensors files)."""
    from safetensors.torch import load_file

    folder = Path(model) / part
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    state = {}
    for f in files:
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    return state


def write_denoiser_file(model: str | Path, part: str, out: str | Path, quant: str | None = None) -> Path:
    """Write `model`'s `part` ('unet' or 'transformer') to `out`: .safetensors, or .gguf quantized as `quant`."""
    out = Path(out)
    state = denoiser_state(model, part)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(out))
        return out
    if out.suffix != ".gguf":
        raise ValueError(f"out: {out} must end in .safetensors or .gguf")
    if quant not in GGUF_TYPES:
        raise ValueError(f"quant: {quant!r}; allowed: {', '.join(GGUF_TYPES)}")
    write_gguf({k: v.numpy() for k, v in state.items()}, out, quant)
    return out


def write_gguf(state: dict[str, np.ndarray], out: Path, quant: str) -> None:
    import gguf

    kind = getattr(gguf.GGMLQuantizationType, quant)
    block, _ = gguf.GGML_QUANT_SIZES[kind]
    writer = gguf.GGUFWriter(str(out), arch="stepserve-tiny")
    for name, array in state.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.ndim >= 2 and array.shape[-1] % block == 0:
            data = quantize_q6_k(array) if quant == "Q6_K" else gguf.quants.quantize(array, kind)
            writer.add_tensor(name, data, raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_q6_k(array: np.ndarray) -> np.ndarray:
    """Q6_K blocks of `array` (last dimension a multiple of 256), as uint8 rows. A super-block of 256 values is
    16 groups of 16, each with an int8 scale of the block's fp16 scale `d`; a value is 6 bits, q - 32 in
    [-32, 31]: y = d * scale[group] * (q - 32). Layout per block: ql (128 bytes, the low 4 bits), qh (64, the
    high 2 bits), scales (16 int8), d (fp16)."""
    shape = array.shape
    x = array.reshape(-1, 256).astype(np.float32)
    groups = x.reshape(-1, 16, 16)
    amax_at = np.take_along_axis(groups, np.abs(groups).argmax(axis=2)[..., None], axis=2)[..., 0]
    scale = -amax_at / 32.0  # the largest magnitude maps to -32 (as ggml's make_qx_quants does with nmax 32)
    biggest = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)[:, 0]
    d = (-biggest / 128.0).astype(np.float16).astype(np.float32)
    inv_d = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    sc = np.clip(np.rint(scale * inv_d[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    inv = np.divide(1.0, step, out=np.zeros_like(step), where=step != 0)
    q = np.clip(np.rint(groups * inv[..., None]), -32, 31).astype(np.int32) + 32  # (blocks, 16, 16) in 0..63
    q = q.reshape(-1, 256)
    ql = np.zeros((q.shape[0], 128), np.uint8)
    qh = np.zeros((q.shape[0], 64), np.uint8)
    for half in range(2):  # dequantize_row_q6_K walks two halves of 128 values
        v = q[:, 128 * half:128 * (half + 1)]
        q1, q2, q3, q4 = v[:, 0:32], v[:, 32:64], v[:, 64:96], v[:, 96:128]
        ql[:, 64 * half:64 * half + 32] = (q1 & 0xF) | ((q3 & 0xF) << 4)
        ql[:, 64 * half + 32:64 * half + 64] = (q2 & 0xF) | ((q4 & 0xF) << 4)
        qh[:, 32 * half:32 * half + 32] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 210)
