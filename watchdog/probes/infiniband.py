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
"""

from __future__ import annotations

from pathlib import Path

SYS_INFINIBAND = Path("/sys/class/infiniband")
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
HW_ERROR_COUNTERS = frozenset(
    {"out_of_sequence", "local_ack_timeout_err", "rnr_nak_retry_err", "packet_seq_err", "implied_nak_seq_err"}
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
