"""The program XLA compiles for a Google TPU, read on any machine: libtpu compiles for a TPU
it does not have through a compile-only topology (``jax.experimental.topologies``), and the
compiled program's text is the optimized TPU HLO. Its top-level fusions are read as the GPU
program's kernels are (:mod:`mpjax._src.tools.gpu_program`): a TPU's matmuls are the convolutions
(or dots) inside its output fusions, its bytes are what moves through HBM (arrays kept in a
core's own memory, VMEM, are not), and its DMAs between the two count as copies.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import jax

from mpjax._src.tools import gpu_program
from mpjax._src.tools.gpu_program import GpuProgram, Roofline

# Each chip: the smallest topology libtpu compiles for (one host's chips; a single-chip
# target runs on its first), and its roofline. The peaks are the chips' published dense
# bfloat16 FLOP/s and HBM bandwidth at the fractions an H200 measured of its own (0.71 of the
# peak, 0.84 of the bandwidth; RESULTS.md's GPU section): no TPU measurement has checked them.
# A float32 matmul runs at the bfloat16 rate (JAX's default precision on a TPU is one
# bfloat16 pass), and FP8 operands too before TPU7x (those chips' MXUs take no float8). A
# fusion costs 1 us beyond its roofline (a TPU launches no kernels; its fusions run back to
# back).
CHIPS: dict[str, tuple[str, Roofline]] = {
    # v5e: 197 TFLOP/s bf16, 819 GB/s
    "v5e": ("v5e:2x2", Roofline(140e12, 140e12, 140e12, 688e9, 1e-6)),
    # v5p: 459 TFLOP/s, 2765 GB/s
    "v5p": ("v5p:2x2x1", Roofline(326e12, 326e12, 326e12, 2323e9, 1e-6)),
    # v6e (Trillium): 918 TFLOP/s, 1640 GB/s
    "v6e": ("v6e:2x2", Roofline(652e12, 652e12, 652e12, 1378e9, 1e-6)),
    # TPU7x (Ironwood), the first TPU whose MXUs take float8: 2307 TFLOP/s bf16, 4614 FP8,
    # 7370 GB/s ("tpu7x"; libtpu's topology is "tpu7x:2x2x1")
    "7x": ("tpu7x:2x2x1", Roofline(1638e12, 3276e12, 1638e12, 6191e9, 1e-6)),
}


def display(chip: str) -> str:
    """A chip's target name: "tpu-v5e", and "tpu7x" as Google writes TPU7x."""
    return f"tpu{chip}" if chip[0].isdigit() else f"tpu-{chip}"


def is_tpu(target: str) -> bool:
    """Whether `target` names a TPU ("tpu-v5e", "TPU-v6e:4x4", ...)."""
    return target.strip().lower().startswith("tpu")


def parse(target: str) -> tuple[str, str, bool]:
    """(chip, libtpu topology name, whether the step spans the topology's chips) of a TPU
    target: "tpu-v5e" is one v5e chip; "tpu-v5e:4x4" a 4x4 slice of them."""
    name = target.strip().lower().removeprefix("tpu").lstrip("-_ ")
    chip, _, shape = name.partition(":")
    if chip not in CHIPS:
        raise ValueError(
            f"unknown TPU target {target!r}: use one of "
            f"{', '.join(display(c) for c in CHIPS)} (one chip), or a slice of one as "
            "'tpu-v5e:2x4' (libtpu's topology names; v5p takes three dimensions, 'tpu-v5p:2x2x2')."
        )
    if not shape:
        return chip, CHIPS[chip][0], False
    return chip, f"{CHIPS[chip][0].split(':')[0]}:{shape}", True


def _install_hint() -> str:
    return (
        "compiling for a TPU target needs libtpu (no TPU needed): "
        f'pip install "jax[tpu]=={jax.__version__}"'
    )


_TOPOLOGIES: dict[str, Any] = {}


def topology(target: str) -> Any:
    """libtpu's compile-only topology for `target` (its devices stand for the chips)."""
    _, name, _ = parse(target)
    if name not in _TOPOLOGIES:
        if importlib.util.find_spec("libtpu") is None:
            raise RuntimeError(_install_hint())
        from jax.experimental import topologies

        # libtpu looks for the TPU VM's worker list (a machine without one compiles alone)
        # and locks its chips against a second process (here there are none to share).
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        try:
            _TOPOLOGIES[name] = topologies.get_topology_desc(platform="tpu", topology_name=name)
        except Exception as e:  # noqa: BLE001 - libtpu's errors name the layout it refused
            raise ValueError(
                f"libtpu has no topology {name!r} (from target {target!r}): {e}. A slice's "
                "shape is a multiple of one host's chips (2x2 for v5e and v6e, 2x2x1 for v5p)."
            ) from None
    return _TOPOLOGIES[name]


def mesh(target: str, shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A mesh over the chips of a TPU target's slice, on any machine: shard a step's
    arguments over it (``jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh, spec))``) and
    ``mpjax.audit(step, *args, target=...)`` shows the program each chip runs, with its
    collectives. Needs libtpu (``pip install "jax[tpu]==<your jax>"``); no TPU.

    Args:
      target: a TPU slice, "tpu-v5e:2x4" (libtpu's topology names: two dimensions for v5e
        and v6e, three for v5p, each a multiple of one host's chips).
      shape: the mesh's shape; its product is the slice's chip count.
      names: the mesh's axis names.

    Example:
      >>> import mpjax
      >>> mpjax.target_mesh("tpu-v9:2x2", (4,), ("data",))
      Traceback (most recent call last):
      ValueError: unknown TPU target 'tpu-v9:2x2': use one of tpu-v5e, tpu-v5p, tpu-v6e, tpu7x ...

      With libtpu installed, a data-parallel step on eight v5e chips::

        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = mpjax.target_mesh("tpu-v5e:2x4", (8,), ("data",))
        dp, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
        x = jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=dp)
        w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=rep)
        step = jax.jit(jax.grad(lambda w, x: jnp.mean((x @ w) ** 2)))
        print(mpjax.audit(step, w, x, target="tpu-v5e:2x4").tpu)  # its all-reduce included
    """
    from jax.experimental import topologies

    return topologies.make_mesh(topology(target), shape, names)


def on_target(tree: Any, target: str) -> Any:
    """`tree` with every array leaf a ``jax.ShapeDtypeStruct`` on `target`'s chips: a leaf
    that carries a sharding over them keeps it; any other is replicated over them."""
    devices = topology(target).devices
    _, _, whole = parse(target)
    used = devices if whole else devices[:1]
    ids = {d.id for d in used}
    replicated = jax.sharding.NamedSharding(
        jax.sharding.Mesh(used, ("chips",)), jax.sharding.PartitionSpec()
    )

    def place(leaf: Any) -> Any:
        own = getattr(leaf, "sharding", None)
        keep = (
            own is not None
            and {d.id for d in own.device_set} <= ids
            and all(getattr(d, "platform", "") == "tpu" for d in own.device_set)
        )
        return gpu_program._abstract(leaf, own if keep else replicated)  # as for a GPU's

    return jax.tree_util.tree_map(place, tree)


@dataclasses.dataclass(frozen=True)
class TpuProgram(GpuProgram):
    """The program XLA compiled for a TPU target: what :func:`mpjax.audit` shows with
    ``target="tpu-v5e"`` (and the other chips). As :class:`GpuProgram`, with the TPU's
    top-level fusions (and DMAs, collectives) as its kernels and HBM bytes as the bytes.

    Attributes:
      chips: how many chips the step spans.
    """

    chips: int = 1

    @property
    def bytes_any_memory(self) -> int:
        """The bytes the program's fusions read and write in either memory, HBM or a core's
        own (VMEM), its DMAs left out: what it would move with every array in HBM. libtpu
        chooses which arrays stay on chip for the whole program, so two variants of one
        step can differ in :attr:`bytes_moved` by that choice alone; in this they differ
        by the work their fusions do.

        Example (on a machine with libtpu)::

          a = jnp.ones((512, 512))
          program = mpjax.audit(lambda a, b: a @ b, a, a, target="tpu-v5e").tpu
          # a and b read, the product written, wherever each lies (one of them in VMEM)
          assert program.bytes_any_memory == 3 * 512 * 512 * 4
        """
        return sum(k.bytes + k.on_chip for k in self.kernels if not k.dma)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "bytes_any_memory": self.bytes_any_memory}

    def roofline(self) -> Roofline:
        return CHIPS[parse(self.target)[0]][1]

    def __str__(self) -> str:
        text = super().__str__().replace(" kernels, ", " fusions, ", 1)
        any_memory = f" ({self.bytes_any_memory / 2**20:.1f} MiB in either memory)"
        text = text.replace(" MiB moved", " MiB moved" + any_memory, 1)
        return text.replace("(tpu gemms)", f"({self.chips} chip{'s' * (self.chips > 1)})", 1)


def read_program(lowered: Any, compiled: Any, text: str, target: str) -> TpuProgram:
    """The :class:`TpuProgram` of a lowering, its TPU compile and that compile's text."""
    base = gpu_program.read_program(lowered, compiled, text, "h100", "tpu")
    chip, name, whole = parse(target)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    shape = name.partition(":")[2]
    fields["target"] = f"{display(chip)}:{shape}" if whole else display(chip)
    return TpuProgram(**fields, chips=len(topology(target).devices) if whole else 1)
