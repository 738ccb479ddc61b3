"""TensorRT optimization profiles for the three networks of an SD-family model, from the serving settings.

TensorRT builds an engine for explicit-batch networks whose dynamic axes (-1 in the ONNX graph) are bounded by an
*optimization profile*: for every dynamic input a min, an opt and a max shape. Kernels are chosen for the opt shape
and must be valid for every shape between min and max; a shape outside the profile is refused when it is set on an
execution context. So the profile has to cover every batch the serving engine can hand a network, and opt should be
the batch it hands most often.

What each network sees, in rows, for a scheduler batch of `n` requests (see stepserve.executor.torch_executor):

- denoiser (`unet`): one row per request, plus one unconditional row per request with guidance_scale > 1
  (classifier-free guidance), so `n` to `2n` rows;
- text encoder: the prompts of newly admitted requests plus their negative prompts, so up to `2n` (fewer when
  prompts repeat or are cached);
- VAE decoder: the images finished in a step, up to `n`, or up to the engine's `max_decode_per_step`.

Rules (documented in docs/DEPLOYMENT.md ("TensorRT engines")):

- min is 1 row for every network: a lone request without guidance, one uncached prompt, one preview decode;
- max is the rows of the largest batch the server can run: `max_batch_size`, or the largest bucket when a compiled
  server pads batches up to bucket sizes (a batch of 5 with buckets 1,2,4,8 runs as 8);
- opt is the rows at the *opt batch*: `--opt-batch` if given, else the bucket a full batch (`max_batch_size`)
  pads to, else `max_batch_size`. Under load a continuously batched server keeps its batch full, so the full batch
  is the one run most often; an idle server runs small batches where speed matters less;
- spatial axes (latent height and width) range over the sizes the model serves (`min_size` .. `max_size` in
  `stepserve.json`, divided by the VAE's scale factor), opt at the model's default size.
"""

from __future__ import annotations

from dataclasses import dataclass

# Network name -> the ONNX file the export writes and the engine file this module's build writes.
NETWORKS = ("text_encoder", "unet", "vae_decoder")
ONNX_FILES = {name: f"{name}.onnx" for name in NETWORKS}
ENGINE_FILES = {name: f"{name}.plan" for name in NETWORKS}


@dataclass(frozen=True)
class ServingSettings:
    """The serving engine's settings a profile depends on.

    `buckets`: batch sizes (in requests) a compiled server pads its batches up to; empty when it runs batches as
    they come. `cfg`: whether requests may use classifier-free guidance (then the denoiser may see twice the rows).
    `max_decode_per_step`: the engine's cap on VAE decodes per step (None: every image finished in the step)."""

    max_batch_size: int = 8
    buckets: tuple[int, ...] = ()
    opt_batch: int | None = None
    cfg: bool = True
    max_decode_per_step: int | None = None

    def __post_init__(self) -> None:
        if not _positive_int(self.max_batch_size):
            raise ValueError(f"max_batch_size: {self.max_batch_size!r} is not allowed; it must be an integer >= 1")
        if any(not _positive_int(b) for b in self.buckets):
            raise ValueError(f"buckets: {list(self.buckets)} is not allowed; each bucket must be an integer >= 1")
        object.__setattr__(self, "buckets", tuple(sorted(set(self.buckets))))
        if self.buckets and self.buckets[-1] < self.max_batch_size:
            raise ValueError(f"buckets: the largest bucket {self.buckets[-1]} is below max_batch_size "
                             f"{self.max_batch_size}, so a full batch could not be padded to a bucket; add a bucket "
                             f">= {self.max_batch_size} or lower max_batch_size")
        if self.max_decode_per_step is not None and not _positive_int(self.max_decode_per_step):
            raise ValueError(f"max_decode_per_step: {self.max_decode_per_step!r} is not allowed; it must be an "
                             "integer >= 1 or None")
        if self.opt_batch is not None:
            if not _positive_int(self.opt_batch) or self.opt_batch > self.largest_batch:
                raise ValueError(f"opt_batch: {self.opt_batch!r} is not allowed; it must be an integer from 1 to "
                                 f"{self.largest_batch} (the largest batch served)")
            if self.buckets and self.opt_batch not in self.buckets:
                raise ValueError(f"opt_batch: {self.opt_batch} is not one of the buckets "
                                 f"{','.join(map(str, self.buckets))}; a padded server only runs bucket sizes")

    @property
    def largest_batch(self) -> int:
        """The most requests one step can run: the largest bucket when batches are padded, else max_batch_size."""
        return self.buckets[-1] if self.buckets else self.max_batch_size

    @property
    def resolved_opt_batch(self) -> int:
        """--opt-batch, else the bucket a full batch pads to, else max_batch_size (see the module docstring)."""
        if self.opt_batch is not None:
            return self.opt_batch
        if self.buckets:
            return next(b for b in self.buckets if b >= self.max_batch_size)
        return self.max_batch_size


@dataclass(frozen=True)
class InputSpec:
    """One input of an ONNX graph as the export's manifest states it: fixed dims are ints, dynamic ones are the
    names the export gave them ("batch", "latent_height", "latent_width")."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class SizeRange:
    """The image sizes the model serves, in pixels (both sides range over min_size..max_size), and the VAE's scale
    factor (pixels per latent cell), which turns them into the latent sizes the denoiser and decoder see."""

    min_size: int
    max_size: int
    default_height: int
    default_width: int
    vae_scale: int

    def latent_range(self, side: str) -> tuple[int, int, int]:
        default = self.default_height if side == "height" else self.default_width
        return (self.min_size // self.vae_scale, default // self.vae_scale, self.max_size // self.vae_scale)


@dataclass(frozen=True)
class TensorProfile:
    """min/opt/max shapes of one input tensor, as TensorRT's IOptimizationProfile.set_shape takes them."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.min) == len(self.opt) == len(self.max):
            raise ValueError(f"{self.name}: min/opt/max shapes have different ranks: {self.min} {self.opt} {self.max}")
        if not all(a <= b <= c for a, b, c in zip(self.min, self.opt, self.max)) or min(self.min, default=1) < 1:
            raise ValueError(f"{self.name}: shapes must be >= 1 and min <= opt <= max on every axis, got "
                             f"min {self.min}, opt {self.opt}, max {self.max}")

    def contains(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.min) and all(a <= s <= c for a, s, c in zip(self.min, shape, self.max))


@dataclass(frozen=True)
class NetworkProfile:
    """One engine to build: its ONNX file, its engine file, and the one optimization profile (index 0) of its
    dynamic inputs. `rows_per_request` is 2 where classifier-free guidance doubles the rows of a request."""

    network: str
    onnx_file: str
    engine_file: str
    inputs: tuple[TensorProfile, ...]
    rows_per_request: int = 1
    batch_range: tuple[int, int, int] = (1, 1, 1)  # min/opt/max rows (axis 0 of every input)
    note: str = ""  # what the batch axis counts

    def input(self, name: str) -> TensorProfile:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(f"{self.network}: no input {name!r}; inputs: {', '.join(t.name for t in self.inputs)}")


# What the batch axis of each network counts, and how many rows a request can add to it.
BATCH_NOTES = {
    "text_encoder": "prompts plus negative prompts of the requests admitted in one step",
    "unet": "one row per request plus one unconditional row per guided request",
    "vae_decoder": "images finished in one step (capped by max_decode_per_step)",
}


def batch_range(network: str, settings: ServingSettings) -> tuple[int, int, int]:
    """min/opt/max rows of a network's batch axis (see the module docstring for the rules)."""
    opt_n, max_n = settings.resolved_opt_batch, settings.largest_batch
    if network in ("text_encoder", "unet"):
        rows = 2 if settings.cfg else 1
        return (1, rows * opt_n, rows * max_n)
    if network == "vae_decoder":
        cap = settings.max_decode_per_step or max_n
        return (1, min(opt_n, cap), min(max_n, cap))
    raise ValueError(f"network: {network!r} is not one of {', '.join(NETWORKS)}")


def network_profile(network: str, inputs: tuple[InputSpec, ...], sizes: SizeRange,
                    settings: ServingSettings) -> NetworkProfile:
    """The profile of one network: each dynamic axis of each input gets its min/opt/max from its name."""
    batch = batch_range(network, settings)
    axes = {"batch": batch, "latent_height": sizes.latent_range("height"),
            "latent_width": sizes.latent_range("width")}
    tensors = []
    for spec in inputs:
        shapes: list[list[int]] = [[], [], []]
        for dim in spec.shape:
            if isinstance(dim, int) and dim >= 1:
                triple = (dim, dim, dim)
            elif isinstance(dim, str) and dim in axes:
                triple = axes[dim]
            else:
                raise ValueError(f"{network}.{spec.name}: axis {dim!r} of shape {list(spec.shape)} is neither a fixed "
                                 f"size nor one of the dynamic axes this exporter knows ({', '.join(axes)})")
            for shape, value in zip(shapes, triple):
                shape.append(value)
        tensors.append(TensorProfile(spec.name, *(tuple(s) for s in shapes)))
    rows = 2 if settings.cfg and network in ("text_encoder", "unet") else 1
    return NetworkProfile(network, ONNX_FILES[network], ENGINE_FILES[network], tuple(tensors), rows, batch,
                          BATCH_NOTES[network])


def network_profiles(inputs: dict[str, tuple[InputSpec, ...]], sizes: SizeRange,
                     settings: ServingSettings) -> list[NetworkProfile]:
    """The profiles of text_encoder, unet and vae_decoder, in that order."""
    missing = [n for n in NETWORKS if n not in inputs]
    if missing:
        raise ValueError(f"the export describes no {', '.join(missing)}; expected networks: {', '.join(NETWORKS)}")
    return [network_profile(n, inputs[n], sizes, settings) for n in NETWORKS]


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
