"""InfiniBand port state and counters from sysfs, and what changed between two reads.

Layout (the kernel's, ``drivers/infiniband/core/sysfs.c``)::

    /sys/class/infiniband/<dev>/ports/<port>/state        "4: ACTIVE"
                                            /phys_state   "5: LinkUp"
                                            /rate         "400 Gb/sec (4X NDR)"
                                            /counters/<name>     decimal
                                            /hw_counters/<name>  decimal (mlx5: retransmits, NAK, ...)

``port_xmit_data``/``port_rcv_data`` count 4-byte words.  A hung collective
over IB shows as data counters standing still; a bad link as error counters
moving.  A counter that goes down between reads was reset (or a 32-bit PMA
counter without extended counters wrapped): no delta is given for it.

No InfiniBand (no ``sys_root``, no device) is None, not an error; an
unreadable counter file is left out.

HCA to GPU (``hca_gpu_map``): ``/sys/class/infiniband/<dev>/device`` links
to the HCA's PCI function under ``/sys/devices/pci<domain>:<bus>/...``, and
``/sys/bus/pci/devices/<bdf>`` to each GPU's; the GPUs nearest an HCA are
those whose resolved paths share the longest prefix with it (same PCIe
switch before same root port before same root complex), which is how NCCL
pairs them too (PIX/PXB/PHB).  A device whose link cannot be resolved is
left out of the map, never placed by guess.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

SYS_INFINIBAND = Path("/sys/class/infiniband")
SYS = Path("/sys")
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA, 3D controller: the first 4 hex digits of the PCI class
WORD_BYTES = 4
DATA_COUNTERS = {"port_xmit_data": "xmit", "port_rcv_data": "rcv"}
ERROR_COUNTERS = frozenset(
    {
        "symbol_error",
        "link_downed",
        "link_error_recovery",
        "port_rcv_errors",
        "port_xmit_discards",
        "local_link_integrity_errors",
        "excessive_buffer_overrun_errors",
        "port_rcv_remote_physical_errors",
        "port_xmit_constraint_errors",
        "port_rcv_constraint_errors",
        "VL15_dropped",
    }
)
# mlx5 hw_counters that count retries, timeouts and failed requests (a healthy link keeps them still).
HW_ERROR_COUNTERS = frozenset(
    {
        "out_of_sequence",
        "local_ack_timeout_err",
        "rnr_nak_retry_err",
        "packet_seq_err",
        "implied_nak_seq_err",
        "req_cqe_error",
        "resp_cqe_error",
        "req_transport_retries_exceeded",
        "roce_adp_retrans",
        "roce_adp_retrans_to",
    }
)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # some hw_counters refuse reads on some firmware
        return None


def _counters(folder: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.iterdir()):
        text = _read(path)
        if text is not None and text.isdigit():
            out[path.name] = int(text)
    return out


def read_ib_counters(sys_root: Path = SYS_INFINIBAND) -> dict | None:
    """{dev: {port: {state, phys_state, rate, counters{name: int}, hw_counters{name: int}}}}, or None."""
    if not sys_root.is_dir():
        return None
    devices: dict[str, dict] = {}
    for dev in sorted(sys_root.iterdir()):
        ports = dev / "ports"
        if not ports.is_dir():
            continue
        devices[dev.name] = {
            port.name: {
                "state": _read(port / "state"),
                "phys_state": _read(port / "phys_state"),
                "rate": _read(port / "rate"),
                "link_layer": _read(port / "link_layer"),
                "counters": _counters(port / "counters"),
                "hw_counters": _counters(port / "hw_counters"),
            }
            for port in sorted(ports.iterdir(), key=lambda p: p.name)
        }
    return devices or None


def ib_delta(before: dict, after: dict, seconds: float) -> dict:
    """Per port (``"<dev>/<port>"``): counter deltas, data in bytes and bytes/s, error counters that moved.

    ``errors`` lists every moved error counter as ``"<dev>/<port> <name> +<n>"`` and every
    (physical) state change as ``"<dev>/<port> state <before> -> <after>"``.
    """
    ports: dict[str, dict] = {}
    errors: list[str] = []
    for dev, dev_ports in sorted(after.items()):
        for port, now in sorted(dev_ports.items()):
            then = before.get(dev, {}).get(port)
            if then is None:
                continue
            label = f"{dev}/{port}"
            ports[label] = entry = _port_delta(then, now, seconds)
            errors += [f"{label} {name} +{n}" for name, n in entry["errors"].items()]
            for key in ("state", "phys_state"):
                if then[key] != now[key]:
                    errors.append(f"{label} {key} {then[key]} -> {now[key]}")
    return {"seconds": seconds, "ports": ports, "errors": errors}


def _port_delta(then: dict, now: dict, seconds: float) -> dict:
    entry: dict = {"state": now["state"], "phys_state": now["phys_state"], "rate": now["rate"], "reset": []}
    moved: dict[str, int] = {}
    for group, watched in (("counters", ERROR_COUNTERS), ("hw_counters", HW_ERROR_COUNTERS)):
        deltas = {}
        for name, value in now[group].items():
            old = then[group].get(name)
            if old is None:
                continue
            if value < old:
                entry["reset"].append(name)
                continue
            deltas[name] = value - old
            if name in watched and value > old:
                moved[name] = value - old
        entry[group] = deltas
    for counter, direction in DATA_COUNTERS.items():
        words = entry["counters"].get(counter)
        entry[f"{direction}_bytes"] = None if words is None else words * WORD_BYTES
        entry[f"{direction}_bytes_per_s"] = None if words is None or seconds <= 0 else words * WORD_BYTES / seconds
    entry["errors"] = moved
    return entry


def normalize_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` or a domain-less ``18:00.0`` -> sysfs's ``0000:18:00.0`` (lower case)."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 3:
        return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
    return ":".join(["0000", *parts]) if len(parts) == 2 else bus_id.strip().lower()


def _pci_path(link: Path) -> tuple[str, ...] | None:
    """The resolved /sys/devices path of a PCI function, as components; None when it cannot be resolved."""
    try:
        real = Path(os.path.realpath(link, strict=True))
    except OSError:
        return None
    return real.parts


def _gpus(sys_root: Path, bus_ids: Sequence[str] | None) -> dict[str, tuple[str, ...]]:
    pci = sys_root / "bus" / "pci" / "devices"
    if bus_ids is not None:
        names = [normalize_bus_id(b) for b in bus_ids]
    elif pci.is_dir():
        names = [
            d.name
            for d in sorted(pci.iterdir())
            if _read(d / "vendor") == NVIDIA_VENDOR and (_read(d / "class") or "").startswith(GPU_CLASSES)
        ]
    else:
        names = []
    paths = {name: _pci_path(pci / name) for name in names}
    return {name: path for name, path in paths.items() if path is not None}


def _distance(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """Hops between two PCI functions through their deepest common ancestor."""
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    return (len(a) - common) + (len(b) - common)


def hca_gpu_map(sys_root: Path = SYS, gpu_bus_ids: Sequence[str] | None = None) -> dict:
    """``{"hcas": {dev: {"pci", "gpus": [nearest bus ids], "hops"}}, "gpus": {bus id: [nearest devs]}}``.

    ``gpu_bus_ids``: the GPUs' bus ids from NVML (any of its spellings);
    None scans ``/sys/bus/pci/devices`` for NVIDIA display/3D functions.
    Empty maps when there is no InfiniBand or no GPU.
    """
    gpus = _gpus(sys_root, gpu_bus_ids)
    ib_class = sys_root / "class" / "infiniband"
    hcas: dict[str, dict] = {}
    nearest_hcas: dict[str, list[str]] = {gpu: [] for gpu in gpus}
    best_for_gpu: dict[str, int] = {}
    for dev in sorted(ib_class.iterdir()) if ib_class.is_dir() else []:
        path = _pci_path(dev / "device")
        if path is None:
            continue
        hops = {gpu: _distance(path, gpu_path) for gpu, gpu_path in gpus.items()}
        best = min(hops.values(), default=None)
        hcas[dev.name] = {"pci": path[-1], "gpus": sorted(g for g, h in hops.items() if h == best), "hops": best}
        for gpu, h in hops.items():
            if h < best_for_gpu.get(gpu, 1 << 30):
                best_for_gpu[gpu], nearest_hcas[gpu] = h, [dev.name]
            elif h == best_for_gpu[gpu]:
                nearest_hcas[gpu].append(dev.name)
    return {"hcas": hcas, "gpus": nearest_hcas}
