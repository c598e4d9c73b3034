"""The hardware a plan is for, as data: presets with their sources, or a small JSON file of your own.

    python -m mmm.plan.simulate --world 512 --tp 8 --hardware h100 ...
    python -m mmm.plan.simulate --world 64 --hardware ./my_cluster.json ...

A :class:`Hardware` is one kind of node: its devices (one rank each), their peak dense FLOP/s by
dtype and memory, and two links: between devices of a node and between nodes, each as the bytes
per second one device can send in one direction, with a latency per collective. A collective whose
process group stays inside a node runs at the first, one whose group spans nodes at the second
(its slowest link). A file of your own gives the same fields (see :data:`PRESETS` for examples;
``peak_tflops`` by dtype, bandwidths in GB/s, memory in GB of 10^9 bytes)::

    {"name": "my cluster", "devices_per_node": 4, "memory_gb": 96,
     "peak_tflops": {"bf16": 989.4, "fp32": 66.9},
     "intra_node_gbps": 450, "inter_node_gbps": 25, "latency_us": 10,
     "matmul_efficiency": 0.6, "memory_bandwidth_gbps": 3350, "memory_efficiency": 0.6,
     "source": "vendor sheet + our all-reduce test"}

(``cores_per_node``: only where CPU ranks share a node's cores, see :class:`Hardware`.)

Figures marked "assumed" in a preset's ``assumed`` list are not from its sources: set them from a
measurement of your own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from mmm.errors import UsageError

GB = 1e9
GIB = 2**30
REQUIRED = ("devices_per_node", "memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps")
# a calibrated file also says what it measured with (model)
FILE_FIELDS = {*REQUIRED, "name", "latency_us", "matmul_efficiency", "cores_per_node", "source", "model"}
FILE_FIELDS |= {"memory_bandwidth_gbps", "memory_efficiency"}


@dataclass(frozen=True)
class Hardware:
    name: str
    devices_per_node: int
    memory_bytes: float
    """Memory of one device (one rank)."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s of one device, by compute dtype (bf16, fp32, ...)."""
    intra_node_bps: float
    """Bytes per second one device sends to another device of its node, one direction."""
    inter_node_bps: float
    """Bytes per second one device sends off its node (the node's network links over its devices)."""
    latency_s: float
    """Start-up time of one collective or send."""
    source: str
    assumed: tuple[str, ...] = field(default=())
    matmul_efficiency: float = 0.6
    """The fraction of peak a step's matrix multiplies and attention reach (measured on an H200 for the h100
    and h200 presets, assumed in the others: set it from a single-device step's profile,
    ``benchmarks/raw_one_gpu.py``). Where ``memory_bps`` is 0 (a calibrated file), the whole step's."""
    memory_bps: float = 0.0
    """Bytes per second of the device's own memory (HBM): the pace of an eager step's memory-bound kernels
    (elementwise ops, norms, casts, the optimizer), which move bytes rather than multiply matrices. 0: not
    counted apart; a calibrated file's ``matmul_efficiency`` measured the whole step and holds them."""
    memory_efficiency: float = 0.6
    """The fraction of ``memory_bps`` those kernels reach (0.59-0.63 measured on an H200, bf16 and fp32)."""
    cores_per_node: int = 0
    """Where ranks share a node's cores (CPU ranks, more of them than cores): the cores. 0: every device
    computes on its own (GPUs)."""

    def link_bps(self, crosses_nodes: bool) -> float:
        return self.inter_node_bps if crosses_nodes else self.intra_node_bps

    def peak(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        raise UsageError(
            f"--hardware {self.name!r} has no peak FLOP/s for dtype {dtype}; it has {', '.join(self.peak_flops)}"
        )


PRESETS: dict[str, Hardware] = {
    "h100": Hardware(
        name="h100",
        devices_per_node=8,
        memory_bytes=80 * GIB,  # as the device reports it (HBM3, "80GB")
        peak_flops={"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
        intra_node_bps=450 * GB,  # NVLink 4: 900 GB/s both directions
        inter_node_bps=50 * GB,  # 8 x 400 Gb/s InfiniBand NDR per node: one NIC per GPU
        latency_s=10e-6,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5); NVIDIA DGX H100 user guide (8 x ConnectX-7); "
        "efficiencies measured on one H100 and one H200 (docs/benchmarks.md#one-gpu)",
        assumed=("latency_s",),
        matmul_efficiency=0.75,  # Llama dim 1,024: H200 0.73 bf16, 0.76 fp32; H100 0.71 bf16 (dim 2,048: 0.77)
        memory_bps=3350 * GB,  # HBM3
        memory_efficiency=0.68,  # H100, Llama dim 1,024, bf16 and bf16 + full AC: 0.67, 0.68 (dim 2,048: 0.74)
    ),
    "a100": Hardware(
        name="a100",
        devices_per_node=8,
        memory_bytes=80 * GIB,
        peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        intra_node_bps=300 * GB,  # NVLink 3: 600 GB/s both directions
        inter_node_bps=25 * GB,  # 8 x 200 Gb/s InfiniBand HDR per node
        latency_s=10e-6,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); NVIDIA DGX A100 user guide (8 x ConnectX-6)",
        assumed=("latency_s", "matmul_efficiency", "memory_efficiency"),
        memory_bps=2039 * GB,  # HBM2e
    ),
    "pvc": Hardware(  # Aurora: one rank per stack (tile), 12 per node
        name="pvc",
        devices_per_node=12,
        memory_bytes=64 * GIB,  # 768 GiB of HBM2e per node, 12 stacks
        peak_flops={"bf16": 419.4e12, "fp16": 419.4e12, "fp32": 26.2e12},  # per stack, as mmm.flops
        intra_node_bps=20 * GB,
        inter_node_bps=200 * GB / 12,  # 8 Slingshot-11 NICs x 200 Gb/s per node, over 12 stacks
        latency_s=20e-6,
        source="ALCF Aurora machine overview (6 GPU Max 1550 x 2 stacks, 768 GiB HBM, 8 Slingshot-11 NICs per "
        "node); Intel Data Center GPU Max 1550 product brief (838.9 TFLOP/s bf16, 3.2768 TB/s per GPU of 2 stacks)",
        assumed=("intra_node_bps", "latency_s", "matmul_efficiency", "memory_efficiency"),
        memory_bps=3276.8 * GB / 2,  # HBM2e, per stack
    ),
    "mi250x": Hardware(  # Frontier: one rank per GCD, 8 per node
        name="mi250x",
        devices_per_node=8,
        memory_bytes=64 * GIB,  # 128 GB (GiB) of HBM2e per package of 2 GCDs
        peak_flops={"bf16": 191.5e12, "fp16": 191.5e12, "fp32": 47.9e12},  # per GCD, as mmm.flops
        intra_node_bps=50 * GB,  # Infinity Fabric between GCDs: 50-100 GB/s
        inter_node_bps=100 * GB / 8,  # 4 Slingshot-11 NICs x 25 GB/s per node, over 8 GCDs
        latency_s=20e-6,
        source="OLCF Frontier user guide (4 MI250X = 8 GCDs, 4 x 25 GB/s NICs per node); AMD Instinct MI250X "
        "datasheet (383 TFLOP/s bf16, 128 GB and 3.2768 TB/s per package of 2 GCDs)",
        assumed=(
            "intra_node_bps",
            "latency_s",
            "matmul_efficiency",
            "memory_efficiency",
        ),  # 50-100 GB/s between GCDs: the low end
        memory_bps=3276.8 * GB / 2,  # HBM2e, per GCD
    ),
}


# the H200: an H100 SXM5's compute and links with more and faster memory
PRESETS["h200"] = replace(
    PRESETS["h100"],
    name="h200",
    memory_bytes=150_109_880_320,  # as the device reports it (HBM3e, "141GB")
    memory_bps=4800 * GB,  # HBM3e
    memory_efficiency=0.6,  # H200, Llama dim 1,024: 0.59 bf16, 0.63 fp32
    source="NVIDIA H200 Tensor Core GPU datasheet (SXM); NVIDIA DGX H200 user guide (8 x ConnectX-7); "
    "efficiencies measured on one H200 (docs/benchmarks.md#one-gpu)",
)


def load_hardware(spec: str) -> Hardware:
    """A preset by name (``h100``, ``h200``, ``a100``, ``pvc``, ``mi250x``) or a JSON file (see the module doc)."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UsageError(
            f"--hardware {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file; give a preset, or a "
            "JSON file (python -m mmm.plan.calibrate writes one for this machine; its fields: docs/planning.md)"
        )
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise UsageError(f"--hardware {spec}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"--hardware {spec}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--hardware {spec}: give a JSON object of fields, not a {type(data).__name__}")
    unknown = sorted(set(data) - FILE_FIELDS)
    if unknown:
        raise UsageError(
            f"--hardware {spec}: unknown field {unknown[0]!r}; the fields are {', '.join(sorted(FILE_FIELDS))}"
        )
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise UsageError(f"--hardware {spec}: missing field {missing[0]!r}; give {', '.join(REQUIRED)}")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks:
        raise UsageError(f'--hardware {spec}: peak_tflops is a map of dtype to TFLOP/s, e.g. {{"bf16": 989.4}}')

    def positive(name, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise UsageError(f"--hardware {spec}: {name} {value!r} must be a positive number")
        return float(value)

    def count(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UsageError(f"--hardware {spec}: {name} {value!r} must be a whole number (0 or more)")
        return value

    efficiency = {}
    for name, default in (("matmul_efficiency", 0.6), ("memory_efficiency", 0.6)):
        efficiency[name] = positive(name, data.get(name, default))
        if efficiency[name] > 1:
            raise UsageError(f"--hardware {spec}: {name} {efficiency[name]} is a fraction of peak, at most 1")
    bandwidth = data.get("memory_bandwidth_gbps")
    return Hardware(
        name=str(data.get("name", path.stem)),
        devices_per_node=count("devices_per_node", data["devices_per_node"]) or int(positive("devices_per_node", 0)),
        memory_bytes=positive("memory_gb", data["memory_gb"]) * GB,
        peak_flops={k: positive(f"peak_tflops[{k!r}]", v) * 1e12 for k, v in peaks.items()},
        intra_node_bps=positive("intra_node_gbps", data["intra_node_gbps"]) * GB,
        inter_node_bps=positive("inter_node_gbps", data["inter_node_gbps"]) * GB,
        latency_s=positive("latency_us", data.get("latency_us", 10)) * 1e-6,
        source=str(data.get("source", str(path))),
        matmul_efficiency=efficiency["matmul_efficiency"],
        memory_bps=positive("memory_bandwidth_gbps", bandwidth) * GB if bandwidth is not None else 0.0,
        memory_efficiency=efficiency["memory_efficiency"],
        cores_per_node=count("cores_per_node", data.get("cores_per_node", 0)),
    )
