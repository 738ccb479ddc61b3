"""The parallel degrees a server runs at, and the one-line refusals of what cannot run (before and after loading).

The world is the product of the degrees, CFG parallel counting 2. Plain data and checks: no torch at import."""

from __future__ import annotations

from dataclasses import dataclass

FLAGS = {"ulysses": "--ulysses-degree", "ring": "--ring-degree", "cfg": "--cfg-parallel",
         "tensor": "--tensor-parallel-size"}


@dataclass(frozen=True)
class Degrees:
    """How one request is split: sequence parallel over ulysses x ring ranks, the CFG rows over 2 when `cfg`,
    the weights over `tensor` ranks."""

    ulysses: int = 1
    ring: int = 1
    cfg: bool = False
    tensor: int = 1

    @property
    def sequence(self) -> int:
        """Ranks a request's tokens are split over."""
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.sequence * self.tensor * (2 if self.cfg else 1)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def describe(self) -> str:
        """The flags that ask for these degrees, as a user typed them ('--ulysses-degree 2 --cfg-parallel')."""
        parts = [f"{FLAGS[k]} {getattr(self, k)}" for k in ("ulysses", "ring", "tensor") if getattr(self, k) > 1]
        return " ".join(parts + (["--cfg-parallel"] if self.cfg else [])) or "one device"

    def flags(self) -> list[str]:
        """The command-line arguments that ask for these degrees (a Ray replica's, a worker's)."""
        return self.describe().split() if self.enabled else []


def check_degrees(d: Degrees, device: str, backend: str, cores: int, gpus: int) -> None:
    """Before anything loads: a ValueError, one line naming the flag and what it needs, for degrees that cannot run
    here. `cores`: CPU cores this process may use; `gpus`: CUDA devices visible."""
    for name in ("ulysses", "ring", "tensor"):
        if getattr(d, name) < 1:
            raise ValueError(f"{FLAGS[name]}: must be 1 or more; got {getattr(d, name)}")
    if not d.enabled:
        return
    if backend != "torch":
        raise ValueError(f"{d.describe()} splits the torch networks; got --backend {backend} (use --backend torch)")
    if d.sequence > 1 and d.tensor > 1:
        raise ValueError(f"{d.describe()}: sequence and tensor parallelism together are not served; allowed: one "
                         f"of them (with --cfg-parallel)")
    cpu = not str(device).startswith("cuda")
    if cpu and d.ring > 1:
        raise ValueError("--ring-degree needs an attention backend that returns the log-sum-exp (flash or cuDNN "
                         "attention on CUDA devices); the CPU's native attention has none: use --ulysses-degree "
                         "on the CPU, or --device cuda")
    if cpu and d.tensor > 1:
        raise ValueError("--tensor-parallel-size needs CUDA devices (diffusers shards the Linear weights as DTensors "
                         "over NCCL; it does not run on device type 'cpu'): use --ulysses-degree or --cfg-parallel "
                         "on the CPU, or --device cuda")
    if cpu and d.world > cores:
        raise ValueError(f"{d.describe()} runs {d.world} ranks, one CPU thread each; this process may use {cores} "
                         f"core(s): lower the degrees")
    if not cpu and d.world > gpus:
        raise ValueError(f"{d.describe()} needs {d.world} CUDA devices, one per rank; {gpus} visible: lower the "
                         f"degrees (or set CUDA_VISIBLE_DEVICES)")


def check_family(d: Degrees, capabilities, heads: int | None) -> None:
    """After the family is known: a ValueError naming the family and the degree it cannot serve. `capabilities`:
    its capabilities.Capabilities; `heads`: its transformer's attention heads (None: no transformer)."""
    title = capabilities.title
    if d.sequence > 1 and not capabilities.sequence_parallel:
        raise ValueError(f"{d.describe()}: {title} has no sequence-parallel plan (its denoiser is a UNet or its "
                         f"transformer has none in diffusers); allowed: --cfg-parallel")
    if d.tensor > 1 and not capabilities.tensor_parallel:
        raise ValueError(f"--tensor-parallel-size: {title}'s transformer has no tensor-parallel plan in diffusers; "
                         f"allowed: Flux.1, Flux.2, Qwen-Image")
    if d.cfg and not capabilities.true_cfg:
        raise ValueError(f"--cfg-parallel: {title} has no unconditional rows to split (its guidance is embedded "
                         f"in the transformer); allowed: --ulysses-degree")
    for name in ("ulysses", "tensor"):
        n = getattr(d, name)
        if n > 1 and heads and heads % n:
            raise ValueError(f"{FLAGS[name]} {n} does not divide {title}'s {heads} attention heads; allowed: a "
                             f"divisor of {heads}")
