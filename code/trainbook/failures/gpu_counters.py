"""What an NVIDIA GPU node reports about its own health, read and graded: ECC errors, remapped
rows, clock slowdown reasons (`nvidia-smi --query-gpu`), NVLink state (`nvidia-smi nvlink -s`)
and Xid events in the kernel log, each Xid triaged with NVIDIA's Xid catalog.

Every parser takes the text a command prints, so it is tested on stored samples written from
NVIDIA's documented formats (book/failures/data/health-gpu-samples.json, constructed, not
captured); `run` calls the commands. Where there is no NVIDIA driver (no nvidia-smi), every
check is a skip that says so; a kernel log given as a file is still triaged, on any machine.

Chapter: book/failures/health.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Check:
    """One line of a health report (`health.run_checks`, `run`)."""

    name: str
    status: str
    value: float | None = None
    unit: str = ""
    expected: float | None = None
    detail: str = ""

    @property
    def ratio(self) -> float | None:
        """value / expected, where both are known."""
        if self.value is None or not self.expected:
            return None
        return self.value / self.expected


COUNTERS = ("ecc", "remapped-rows", "clocks", "nvlink", "xid")
FIELDS = ("index", "pci.bus_id", "name", "ecc.errors.uncorrected.volatile.total",
          "ecc.errors.uncorrected.aggregate.total", "remapped_rows.pending",
          "remapped_rows.failure", "clocks_event_reasons.active", "temperature.gpu")
OLD_FIELDS = {"clocks_event_reasons.active": "clocks_throttle_reasons.active"}  # drivers < 535

# nvml.h, nvmlClocksEventReason*: why the clocks are below their maximum
CLOCK_REASONS = {0x1: "GPU idle", 0x2: "applications clocks setting", 0x4: "SW power cap",
                 0x8: "HW slowdown", 0x10: "sync boost", 0x20: "SW thermal slowdown",
                 0x40: "HW thermal slowdown", 0x80: "HW power brake slowdown",
                 0x100: "display clock setting"}
SLOW_FAIL = 0x8 | 0x40 | 0x80  # the hardware is slowing itself: this GPU will straggle
SLOW_WARN = 0x20


@dataclass(frozen=True)
class Xid:
    """An Xid from NVIDIA's catalog (Ampere and newer): its mnemonic, description and the
    catalog's immediate and investigatory actions, plus the triage this book gives it."""

    code: int
    mnemonic: str
    description: str
    immediate: str
    investigatory: str
    triage: str  # application bug, restart the job, reset GPU, drain node, watch


# docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html (catalog for Ampere and newer);
# the last column is this book's reading of the catalog's actions for a training job's on-call
XID_CATALOG = {x.code: x for x in (
    Xid(13, "ROBUST_CHANNEL_GR_EXCEPTION", "Graphics Engine Exception", "RESTART_APP",
        "WORKFLOW_XID_13", "application bug"),
    Xid(31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault", "RESTART_APP",
        "WORKFLOW_XID_31", "application bug"),
    Xid(43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing", "IGNORE",
        "CONTACT_SUPPORT", "application bug"),
    Xid(45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "Preemptive cleanup, due to previous errors",
        "WORKFLOW_XID_45", "alone: RESTART_FM; with others: follow the other Xid",
        "restart the job"),
    Xid(48, "ROBUST_CHANNEL_GPU_ECC_DBE", "Double Bit ECC Error", "WORKFLOW_XID_48",
        "WORKFLOW_XID_48", "reset GPU"),
    Xid(61, "PMU_BREAKPOINT", "Unused", "CONTACT_SUPPORT", "", "drain node"),
    Xid(62, "PMU_HALT_ERROR", "Internal micro-controller halt", "RESET_GPU", "CONTACT_SUPPORT",
        "reset GPU"),
    Xid(63, "INFOROM_DRAM_RETIREMENT_EVENT", "GPU memory remapping event", "IGNORE", "IGNORE",
        "watch"),
    Xid(64, "INFOROM_DRAM_RETIREMENT_FAILURE", "GPU memory remapping failure", "RESET_GPU",
        "CONTACT_SUPPORT", "drain node"),
    Xid(74, "NVLINK_ERROR", "NVLINK Error", "WORKFLOW_NVLINK_ERR", "CONTACT_SUPPORT",
        "drain node"),
    Xid(79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus",
        "RESTART_BM", "CONTACT_SUPPORT", "drain node"),
    Xid(92, "EXCESSIVE_SBE_INTERRUPTS", "High single-bit ECC error rate", "IGNORE",
        "CONTACT_SUPPORT", "watch"),
    Xid(94, "ROBUST_CHANNEL_CONTAINED_ERROR", "Contained memory error", "RESTART_APP",
        "IGNORE (sympathetic)", "restart the job"),
    Xid(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "Uncontained memory error", "RESET_GPU",
        "IGNORE (sympathetic)", "reset GPU"),
    Xid(119, "GSP_RPC_TIMEOUT", "GSP RPC Timeout", "RESET_GPU", "INVESTIGATE_SW", "reset GPU"),
    Xid(120, "GSP_ERROR", "GSP Error", "RESET_GPU", "INVESTIGATE_SW", "reset GPU"),
)}
FAILING = ("reset GPU", "drain node")  # the node cannot take the next job as it is
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+),\s*(.*)")
_LINK = re.compile(r"^\s*Link (\d+): (.*?)\s*$")
_GPU = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: ([^)]*)\))?\s*$")


# ---- parsers -------------------------------------------------------------------------------------

def _value(text: str) -> Any:
    text = text.strip()
    if not text or text.strip("[]") in ("N/A", "Not Supported", "Unknown Error", "Not Found"):
        return None
    if text in ("Yes", "No"):
        return text == "Yes"
    if re.fullmatch(r"0x[0-9A-Fa-f]+", text):
        return int(text, 16)
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def parse_query(text: str, fields: tuple[str, ...] = FIELDS) -> list[dict[str, Any]]:
    """`nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits` output: one dict per GPU;
    N/A and Not Supported become None, Yes/No booleans, 0x... integers."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(fields):
            raise ValueError(f"nvidia-smi printed {len(parts)} fields where {len(fields)} were "
                             f"asked for: {line!r}")
        rows.append({f: _value(p) for f, p in zip(fields, parts)})
    return rows


def parse_nvlink(text: str) -> dict[int, list[float | None]]:
    """`nvidia-smi nvlink -s` output: each GPU's links in GB/s, None for an inactive link."""
    out: dict[int, list[float | None]] = {}
    gpu = None
    for line in text.splitlines():
        if m := _GPU.match(line):
            gpu = int(m[1])
            out[gpu] = []
        elif (m := _LINK.match(line)) and gpu is not None:
            speed = re.match(r"([\d.]+)\s*GB/s", m[2])
            out[gpu].append(float(speed[1]) if speed else None)
    return out


def parse_xids(text: str) -> list[dict[str, Any]]:
    """Xid lines of a kernel log (dmesg, journalctl -k): bus id, code, the message, triaged."""
    out = []
    for line in text.splitlines():
        if m := _XID.search(line):
            code = int(m[2])
            entry = XID_CATALOG.get(code)
            out.append({"bus": m[1], "xid": code, "message": m[3].strip(),
                        "mnemonic": entry.mnemonic if entry else None,
                        "triage": entry.triage if entry else "look it up"})
    return out


def clock_reasons(mask: int) -> list[str]:
    """The names of the bits set in a clocks event reasons mask."""
    return [name for bit, name in CLOCK_REASONS.items() if mask & bit]


# ---- grading -------------------------------------------------------------------------------------

def check_query(rows: list[dict[str, Any]]) -> list[Check]:
    """ECC, remapped rows and clock slowdowns of every GPU, one Check each."""
    out = []
    for r in rows:
        gpu = f"GPU {r['index']} ({r['pci.bus_id']})"
        vol, agg = r["ecc.errors.uncorrected.volatile.total"], \
            r["ecc.errors.uncorrected.aggregate.total"]
        if vol is None and agg is None:
            out.append(Check(f"ecc {r['index']}", "skip", detail=f"{gpu}: ECC not reported"))
        elif vol:
            out.append(Check(f"ecc {r['index']}", "fail", vol, "errors", 0, f"{gpu}: {vol} "
                             "uncorrectable ECC error(s) since the driver loaded: reset the "
                             "GPU"))
        else:
            status = "warn" if agg else "pass"
            out.append(Check(f"ecc {r['index']}", status, agg or 0, "errors", 0,
                             f"{gpu}: {agg or 0} uncorrectable ECC error(s) in its "
                             "lifetime"))
        pending, failed = r["remapped_rows.pending"], r["remapped_rows.failure"]
        if failed:
            out.append(Check(f"remapped-rows {r['index']}", "fail", detail=f"{gpu}: a row "
                             "remapping failed: the memory cannot be repaired; drain the node"))
        elif pending:
            out.append(Check(f"remapped-rows {r['index']}", "fail", detail=f"{gpu}: a remap "
                             "is pending: reset the GPU to apply it before the next job"))
        else:
            out.append(Check(f"remapped-rows {r['index']}", "pass" if pending is not None
                             else "skip", detail=f"{gpu}: none pending or failed"
                             if pending is not None else f"{gpu}: not reported"))
        mask = r.get("clocks_event_reasons.active")
        if mask is None:
            out.append(Check(f"clocks {r['index']}", "skip", detail=f"{gpu}: not reported"))
        else:
            names = ", ".join(clock_reasons(mask)) or "none"
            status = "fail" if mask & SLOW_FAIL else "warn" if mask & SLOW_WARN else "pass"
            out.append(Check(f"clocks {r['index']}", status, detail=f"{gpu}: clocks held back "
                             f"by: {names} ({r['temperature.gpu']} C)"))
    return out


def check_nvlink(links: dict[int, list[float | None]]) -> list[Check]:
    """Every GPU's links all up at one speed (a GPU without NVLink reports none: skip)."""
    if not any(links.values()):
        return [Check("nvlink", "skip", detail="no NVLink links reported")]
    best = max(s for speeds in links.values() for s in speeds if s is not None)
    out = []
    for gpu, speeds in links.items():
        down = [i for i, s in enumerate(speeds) if s is None]
        slow = [i for i, s in enumerate(speeds) if s is not None and s < best]
        if down:
            out.append(Check(f"nvlink {gpu}", "fail", detail=f"GPU {gpu}: links {down} "
                             "inactive: collectives will fall back or hang; drain the node"))
        elif slow:
            out.append(Check(f"nvlink {gpu}", "warn", min(speeds), "GB/s", best,
                             f"GPU {gpu}: links {slow} slower than the others"))
        else:
            out.append(Check(f"nvlink {gpu}", "pass", best, "GB/s", best,
                             f"GPU {gpu}: {len(speeds)} links up"))
    return out


def check_xids(xids: list[dict[str, Any]]) -> list[Check]:
    """One Check per Xid code seen: fail when the triage is to reset the GPU or drain the
    node, warn otherwise; pass when the log has none."""
    if not xids:
        return [Check("xid", "pass", 0, "events", detail="no Xid events in the kernel log")]
    out = []
    for code in sorted({x["xid"] for x in xids}):
        seen = [x for x in xids if x["xid"] == code]
        triage = seen[0]["triage"]
        buses = sorted({x["bus"] for x in seen})
        name = seen[0]["mnemonic"] or "not in the catalog table"
        out.append(Check(f"xid {code}", "fail" if triage in FAILING else "warn", len(seen),
                         "events", detail=f"{name} on {', '.join(buses)}: {triage}"))
    return out


# ---- running the commands ------------------------------------------------------------------------

def _cmd(argv: list[str], timeout_s: float = 30) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()[:500]}")
    return r.stdout


def query(smi: str = "nvidia-smi") -> list[dict[str, Any]]:
    """Run the query (with the pre-535 name of the clocks field if the driver wants it)."""
    fields = FIELDS
    try:
        text = _cmd([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    except RuntimeError as e:
        if "not a valid field" not in str(e):
            raise
        fields = tuple(OLD_FIELDS.get(f, f) for f in FIELDS)
        text = _cmd([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    rows = parse_query(text, fields)
    for r in rows:  # one name for the clocks field, whichever the driver used
        if "clocks_throttle_reasons.active" in r:
            r["clocks_event_reasons.active"] = r.pop("clocks_throttle_reasons.active")
    return rows


def kernel_log() -> str:
    """The kernel ring buffer (dmesg; journalctl -k where dmesg is restricted)."""
    for argv in (["dmesg"], ["journalctl", "-k", "-b", "--no-pager"]):
        if shutil.which(argv[0]):
            try:
                return _cmd(argv)
            except (RuntimeError, subprocess.TimeoutExpired):
                continue
    raise RuntimeError("cannot read the kernel log (dmesg and journalctl -k failed): run as "
                       "root, or pass --kernel-log FILE")


def run(counters: list[str] | tuple[str, ...] = COUNTERS, kernel_log_file: str | None = None,
        smi: str = "nvidia-smi") -> list[Check]:
    """The counter checks asked for. Without nvidia-smi they are skipped (the Xid check still
    reads a kernel log given as a file)."""
    unknown = sorted(set(counters) - set(COUNTERS))
    if unknown:
        raise ValueError(f"unknown counter check {unknown[0]!r}; choose from {', '.join(COUNTERS)}")
    have_smi = shutil.which(smi) is not None
    out: list[Check] = []
    if {"ecc", "remapped-rows", "clocks"} & set(counters):
        if have_smi:
            wanted = [c for c in check_query(query(smi)) if c.name.split()[0] in counters]
            out += wanted
        else:
            out += [Check(c, "skip", detail="no NVIDIA driver here (nvidia-smi not found)")
                    for c in ("ecc", "remapped-rows", "clocks") if c in counters]
    if "nvlink" in counters:
        out += check_nvlink(parse_nvlink(_cmd([smi, "nvlink", "-s"]))) if have_smi else \
            [Check("nvlink", "skip", detail="no NVIDIA driver here (nvidia-smi not found)")]
    if "xid" in counters:
        if kernel_log_file is not None:
            try:
                text = Path(kernel_log_file).read_text(errors="replace")
            except OSError as e:
                raise ValueError(f"cannot read the kernel log {kernel_log_file}: {e}") from None
            out += check_xids(parse_xids(text))
        elif have_smi:
            out += check_xids(parse_xids(kernel_log()))
        else:
            out.append(Check("xid", "skip", detail="no NVIDIA driver here; give --kernel-log "
                             "FILE to triage a saved log"))
    return out
