"""trainbook gpumeasure: measure the device at hand once, and store every number as data.

Five measurements, each written as one JSON file under --out (default data/gpu/<device>/) with
the command line, the UTC date, the versions (python, torch, CUDA/HIP, the trainbook commit) and
the device: (1) MAMF, the best matmul TFLOPS per dtype (bf16, fp16, tf32, fp8 on a GPU that has
them; fp32 and bf16 on a CPU; a refused dtype is recorded with the reason); (2) the reference
trainer's tokens/s, MFU and peak memory against the memory estimator; (3) a torch.profiler step
profile, time by operator class, with the chrome trace beside it (Perfetto opens it); (4) the
estimator against the measured peak of three single-device setups (torch.cuda.max_memory_allocated
on a GPU, MemTracker on a CPU); (5) an FP8 linear layer's three matmuls, casts included,
against bf16 (`bench.fp8_linear`, Llama 3 8B's shapes; torchao's Float8Linear too where torchao
is installed; refused without FP8 tensor cores). One --budget-s is shared: each measurement
gets a slice of what is left and is skipped, with the reason recorded, when its slice is too
small.
Example (one GPU, under 8 minutes): tools/gpu/measure.sh, or python -m trainbook gpumeasure

Chapter: book/compute/throughput; book/precision/fp8 (fp8-linear).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from .. import hardware
from ..bench import fp8_linear, matmul
from ..bench import gpu_truth as G
from ..bench.timing import default_flush_bytes
from ..launch import resolve_device
from ..report import table
from ._args import check_writable, command_line

HELP = ("measure this GPU (or CPU) once: MAMF, trainer tokens/s and MFU, a step profile, "
        "memory, an FP8 linear layer against bf16")

GPU_DTYPES, CPU_DTYPES = ("bf16", "fp16", "tf32", "fp8"), ("fp32", "bf16", "tf32", "fp8")
WEIGHTS = {"mamf": 1.0, "profile": 1.5, "train": 3.0, "memory": 3.0, "fp8": 1.5}  # of the budget
MIN_S = {"small": {"mamf": 0.5, "profile": 2.0, "train": 3.0, "memory": 2.0, "fp8": 1.0},
         "large": {"mamf": 5.0, "profile": 10.0, "train": 20.0, "memory": 15.0, "fp8": 10.0}}
FP8_SHAPES = {  # (tokens M, inputs K, outputs N): Llama 3 8B's linears at 8192 tokens per GPU
    "large": [(8192, 4096, 6144), (8192, 4096, 4096), (8192, 4096, 28672), (8192, 14336, 4096)],
    "small": [(1024, 1024, 1024), (2048, 2048, 2048)]}
TRAIN_OVERHEAD_S = {"small": 3.0, "large": 30.0}  # data, tokenizer, evaluation, peak lookup
LARGE_GPU = dict(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, d_ff=5632)  # ~0.8B
MODELS = {  # size, device type -> trainer options of the reference model and its run
    ("small", "cpu"): dict(overrides={}, tokenizer="bytes", vocab_size=256, seq_len=64,
                           micro_batch=8, max_steps=10),
    ("small", "cuda"): dict(overrides={}, tokenizer="bytes", vocab_size=256, seq_len=64,
                            micro_batch=8, max_steps=30),
    ("large", "cpu"): dict(overrides=dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                                          d_ff=1408), tokenizer="bytes", vocab_size=256,
                           seq_len=256, micro_batch=8, max_steps=10),
    ("large", "cuda"): dict(overrides=LARGE_GPU, tokenizer="bpe", vocab_size=8192, seq_len=2048,
                            micro_batch=None, max_steps=50),  # micro-batch: the largest that fits
}
GPU_MEMORY_USE = 0.6  # of the device's memory, by the estimator: context, allocator, profiler


class Skipped(Exception):
    """A measurement that did not run, and why (recorded, not an error)."""


class Refused(Exception):
    """A dtype this device cannot multiply in (matmul.check_dtype's reason)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (GPU if visible), cpu, cuda or cuda:N")
    p.add_argument("--size", default=None, help="small or large: the model and shapes measured "
                                                "(default: large on a GPU, small on a CPU)")
    p.add_argument("--budget-s", type=float, default=420.0, metavar="SECONDS",
                   help="time shared by all measurements; each gets a slice of what is left and "
                        "is skipped, with the reason recorded, if that is too small (default 420: "
                        "under 8 minutes in all on one GPU)")
    p.add_argument("--out", metavar="DIR",
                   help="folder for the JSON files (default data/gpu/<device-slug>/)")
    p.add_argument("--json", action="store_true", help="print a summary of what was written as "
                                                       "JSON (progress goes to stderr)")


def _validate(args) -> tuple[torch.device, str, Path]:
    """Every input checked before any work: a ValueError is one `error:` line, exit status 2."""
    if args.size is not None and args.size not in G.SIZES:
        raise ValueError(f"unknown size {args.size!r}: use {' or '.join(G.SIZES)}")
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        raise ValueError(f"--budget-s must be a positive number of seconds, got {args.budget_s:g}")
    device = resolve_device(args.device)
    size = args.size or ("large" if device.type == "cuda" else "small")
    out = Path(args.out) if args.out else Path("data") / "gpu" / G.device_slug(device)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    check_writable(str(out), "--out", folder=True)
    return device, size, out


def _plan(size: str, device: torch.device) -> dict:
    """The reference model and micro-batch for this size and device, sized by the estimator on a
    GPU (the largest of 8, 4, 2, 1 sequences, then fewer layers, within GPU_MEMORY_USE)."""
    from ..train import TrainConfig, model_config

    spec = dict(MODELS[(size, device.type)])
    gpu, dtype = device.type == "cuda", "bf16" if device.type == "cuda" else "fp32"

    def mcfg_for(overrides):
        cfg = TrainConfig(model="tiny-llama", tokenizer=spec["tokenizer"],
                          vocab_size=spec["vocab_size"], seq_len=spec["seq_len"], **overrides)
        return model_config(cfg, spec["vocab_size"])

    overrides, mb = dict(spec["overrides"]), spec["micro_batch"]
    mcfg = mcfg_for(overrides)
    if mb is None:
        capacity = GPU_MEMORY_USE * torch.cuda.get_device_properties(device).total_memory
        while (mb := G.fit_micro_batch(mcfg, spec["seq_len"], dtype, capacity)) is None:
            if overrides.get("n_layers", 2) <= 2:
                raise ValueError(f"{G.device_slug(device)}: even a 2-layer model of the large "
                                 "size does not fit; use --size small")
            overrides["n_layers"] = overrides["n_layers"] // 2
            mcfg = mcfg_for(overrides)
    return dict(spec, overrides=overrides, micro_batch=mb, model=mcfg, dtype=dtype, gpu=gpu)


class _Run:
    """One gpumeasure run: the plan, the budget, and what earlier measurements learned (the step
    time sizes the trainer and the memory runs)."""

    def __init__(self, args, device, size, out):
        self.args, self.device, self.size, self.out = args, device, size, out
        self.plan = _plan(size, device)
        self.command = command_line(args)
        self.step_s: float | None = None
        self.tflops: dict[str, float] = {}
        self.rows: list[dict] = []

    def est_step_s(self, micro_batch: int | None = None) -> float:
        """The measured step time, or a pessimistic guess (5% of the matmul rate) without one."""
        mb = micro_batch or self.plan["micro_batch"]
        if self.step_s is not None:
            return self.step_s * mb / self.plan["micro_batch"]
        dtype = self.plan["dtype"]
        rate = self.tflops.get(dtype) or matmul.probe_tflops(dtype, self.device)
        return G.step_flops(self.plan["model"], mb, self.plan["seq_len"]) / (rate * 1e12 * 0.05)

    def measure(self, name: str, fn, budget: G.Budget | None, kind: str) -> None:
        """Run one measurement in its slice and write its record, whatever happens."""
        rec = G.header(name, self.command, self.device, self.size)
        slice_s = budget.take(name) if budget else 0.0
        rec.update(status="measured", reason=None, budget={
            "total_s": self.args.budget_s, "left_s": budget.left() if budget else None,
            "slice_s": slice_s}, result=None)
        t0 = time.perf_counter()
        try:
            if budget is not None and slice_s < MIN_S[self.size][kind]:
                raise Skipped(f"time budget spent: a slice of {slice_s:.1f} s of the "
                              f"{budget.left():.1f} s left, and {kind} needs at least "
                              f"{MIN_S[self.size][kind]:g} s; give a larger --budget-s")
            rec["result"] = fn(slice_s)
        except Refused as e:
            rec.update(status="refused", reason=str(e.args[0]))
        except Skipped as e:
            rec.update(status="skipped", reason=str(e))
        except Exception as e:  # one failure must not lose the other measurements
            rec.update(status="failed", reason=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc()[-4000:])
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        rec["elapsed_s"] = time.perf_counter() - t0
        path = G.write_record(self.out, name, rec)
        row = {"name": name, "status": rec["status"], "seconds": round(rec["elapsed_s"], 2),
               "file": str(path), "reason": rec["reason"]}
        self.rows.append(row)
        print(f"gpumeasure: {name}: {rec['status']} in {rec['elapsed_s']:.1f} s"
              + (f" ({rec['reason']})" if rec["reason"] else ""), file=sys.stderr)

    # ---- the measurements ----------------------------------------------------------------------

    def mamf(self, dtype: str, slice_s: float) -> dict:
        gpu = self.device.type == "cuda"
        repeats, warmup = (50, 10) if gpu else (10, 2)
        flush = default_flush_bytes(self.device, small=self.size == "small")
        sw = matmul.sweep(G.mamf_shapes(self.size, self.device.type), dtype, str(self.device),
                          repeats, warmup, flush, progress=False, command=self.command,
                          budget_s=slice_s)
        if not sw.results:
            raise Skipped(f"no shape fits this budget slice of {slice_s:.1f} s; give a larger "
                          "--budget-s")
        summary = sw.summary()
        best = summary["best_max"]["tflops"]
        self.tflops[dtype] = best
        spec = hardware.match_device_name(summary["device_name"]) if gpu else None
        spec_tflops = spec.tflops.get(dtype) if spec else None
        return {"dtype": dtype, "best_tflops": best, "summary": summary,
                "spec": spec.name if spec else None, "spec_tflops": spec_tflops,
                "best_over_spec": best / spec_tflops if spec_tflops else None,
                "repeats": repeats, "warmup": warmup, "flush_bytes": flush, "rows": sw.rows(),
                "skipped_shapes": [list(s) for s in sw.skipped]}

    def profile(self, slice_s: float) -> dict:
        p = self.plan
        need = 15 * self.est_step_s() + 1  # 5 steps, profiled ones cost more; the model build
        if need > slice_s:
            raise Skipped(f"a profile of 5 steps needs ~{need:.1f} s, more than this budget slice "
                          f"of {slice_s:.1f} s")
        trace = self.out / "profile-trace.json.gz"
        r = G.profile_steps(p["model"], p["micro_batch"], p["seq_len"], p["dtype"], self.device,
                            trace)
        self.step_s = r["step_s_unprofiled"]
        return {"model_config": p["model"].to_dict(), "micro_batch": p["micro_batch"],
                "seq_len": p["seq_len"], "dtype": p["dtype"], "trace": trace.name,
                "classes": list(G.CLASSES), **r}

    def train(self, slice_s: float) -> dict:
        from ..train import TrainConfig, train
        from .train import summary

        p, gpu = self.plan, self.plan["gpu"]
        step_s = self.est_step_s()
        steps = min(p["max_steps"], int((slice_s - TRAIN_OVERHEAD_S[self.size]) / (1.5 * step_s)))
        if steps < 3:
            raise Skipped(f"3 training steps of ~{step_s:.2f} s and {TRAIN_OVERHEAD_S[self.size]:g}"
                          f" s of set-up do not fit this budget slice of {slice_s:.1f} s")
        with tempfile.TemporaryDirectory() as cache:
            cfg = TrainConfig(model="tiny-llama", **p["overrides"], tokenizer=p["tokenizer"],
                              vocab_size=p["vocab_size"], seq_len=p["seq_len"],
                              batch_size=p["micro_batch"], steps=steps, warmup_steps=1,
                              dtype=p["dtype"], device=str(self.device), log_every=0,
                              eval_batches=2, progress=False, cache_dir=cache)
            base = 0
            if gpu:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                base = torch.cuda.memory_allocated(self.device)
            with contextlib.redirect_stdout(sys.stderr):
                result = train(cfg)
            peak = torch.cuda.max_memory_allocated(self.device) - base if gpu else None
        s = summary(result)
        est = G.estimate(result.model_config, cfg.batch_size, cfg.seq_len, cfg.dtype,
                         cfg.recompute, cfg.grad_accum)
        memory = {"measured_bytes": peak, "estimated_bytes": est.peak,
                  "estimated_over_measured": est.peak / peak if peak else None,
                  "estimate": est.as_dict(),
                  "how": "torch.cuda.max_memory_allocated over the whole run (set-up, steps, "
                         "evaluation), less what was allocated before" if gpu else None,
                  "why_null": None if gpu else "torch.cuda.max_memory_allocated needs a GPU, and "
                  "a CPU process's RSS does not count tensors; see memory.json (MemTracker)"}
        return {"config": dataclasses.asdict(cfg) | {"cache_dir": None},
                "model_config": result.model_config.to_dict(), "summary": s,
                "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"],
                "peak_flops": s["peak_flops"], "peak_source": s["peak_source"],
                "peak_memory": memory, "history": result.history}

    def memory(self, slice_s: float) -> dict:
        from ..bench.memory_measure import measure_step

        p, gpu, t0 = self.plan, self.plan["gpu"], time.perf_counter()
        mb, dtype = p["micro_batch"], p["dtype"]
        setups = [(mb, "none"), (mb, "full"), (mb // 2, "none") if mb >= 2 else (2, "full")]
        entries = []
        for micro_batch, recompute in setups:
            est = G.estimate(p["model"], micro_batch, p["seq_len"], dtype, recompute)
            cost = (3 * self.est_step_s(micro_batch) + 3 if gpu  # 2 steps and the model build
                    else 40 * self.est_step_s(micro_batch) + 0.5)  # MemTracker is slow
            entry = {"micro_batch": micro_batch, "seq_len": p["seq_len"], "recompute": recompute,
                     "dtype": dtype, "estimated_bytes": est.peak, "estimate": est.as_dict()}
            if time.perf_counter() - t0 + cost > slice_s:
                entries.append(entry | {"status": "skipped", "reason": f"needs ~{cost:.1f} s, "
                                        f"{slice_s - (time.perf_counter() - t0):.1f} s left"})
                continue
            if gpu:
                m = G.cuda_step_peak(p["model"], micro_batch, p["seq_len"], recompute, dtype,
                                     self.device)
            else:
                m = measure_step(p["model"], micro_batch, p["seq_len"], recompute, dtype)
            entries.append(entry | {"status": "measured", "measured_bytes": m["peak"],
                                    "estimated_over_measured": est.peak / m["peak"],
                                    "measured": m})
        if not any(e["status"] == "measured" for e in entries):
            raise Skipped(f"no setup fits this budget slice of {slice_s:.1f} s: "
                          + "; ".join(e["reason"] for e in entries))
        how = ("torch.cuda.max_memory_allocated over one steady-state step (bf16 autocast, fp32 "
               "weights and AdamW state), less what was allocated before the model" if gpu else
               "on a CPU: trainbook.bench.memory_measure.measure_step, MemTracker's peak of one "
               "steady-state fp32 step (torch.cuda.max_memory_allocated needs a GPU)")
        return {"how": how, "model_config": p["model"].to_dict(), "setups": entries}

    def fp8_linear(self, slice_s: float) -> dict:
        shapes = FP8_SHAPES[self.size]
        rows, torchao, t0 = [], [], time.perf_counter()
        for m, k, n in shapes:
            left = slice_s - (time.perf_counter() - t0)
            if left < MIN_S[self.size]["fp8"] / len(shapes):
                break
            share = left / (2 * (len(shapes) - len(rows)))
            rows.append(fp8_linear.time_step(m, k, n, self.device, budget_s=share))
            torchao.append(fp8_linear.torchao_times(m, k, n, self.device, budget_s=share))
        if not rows:
            raise Skipped(f"no shape fits this budget slice of {slice_s:.1f} s")
        return {"how": "median of CUDA-event times of one linear layer's forward and two "
                       "backward matmuls: bf16 (torch.matmul), FP8 through torch._scaled_mm "
                       "with the amax, scaling and casts included (tensorwise: E4M3 x, W and "
                       "E5M2 gradients; rowwise: E4M3 throughout), and the FP8 matmuls alone "
                       "on operands cast beforehand (trainbook.bench.fp8_linear)",
                "rows": rows, "torchao": torchao,
                "skipped_shapes": [list(s) for s in shapes[len(rows):]]}


def run(args: argparse.Namespace) -> int:
    device, size, out = _validate(args)
    r = _Run(args, device, size, out)
    out.mkdir(parents=True, exist_ok=True)
    dtypes = GPU_DTYPES if device.type == "cuda" else CPU_DTYPES
    refused = {}
    for d in dtypes:
        try:
            matmul.check_dtype(d, device)
        except ValueError as e:
            refused[d] = str(e)
    weights = {f"mamf-{d}": WEIGHTS["mamf"] for d in dtypes if d not in refused}
    weights.update(profile=WEIGHTS["profile"], train=WEIGHTS["train"], memory=WEIGHTS["memory"])
    if "fp8" not in refused:
        weights["fp8-linear"] = WEIGHTS["fp8"]
    budget = G.Budget(args.budget_s, weights)
    t0 = time.perf_counter()
    for d in dtypes:
        if d in refused:
            def refuse(_, why=refused[d]):
                raise Refused(why)
            r.measure(f"mamf-{d}", refuse, None, "mamf")
        else:
            r.measure(f"mamf-{d}", lambda s, d=d: r.mamf(d, s), budget, "mamf")
    r.measure("profile", r.profile, budget, "profile")
    r.measure("train", r.train, budget, "train")
    r.measure("memory", r.memory, budget, "memory")
    if "fp8" in refused:
        def refuse_fp8(_, why=refused["fp8"]):
            raise Refused(why)
        r.measure("fp8-linear", refuse_fp8, None, "fp8")
    else:
        r.measure("fp8-linear", r.fp8_linear, budget, "fp8")
    failed = [row["name"] for row in r.rows if row["status"] == "failed"]
    doc = {"out": str(out), "device": G.device_info(device), "size": size,
           "budget_s": args.budget_s, "elapsed_s": time.perf_counter() - t0,
           "measurements": r.rows}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{doc['device']['name']}, size {size}: {len(r.rows)} records in {out}/ "
              f"({doc['elapsed_s']:.0f} s of a {args.budget_s:g} s budget)")
        print(table(r.rows, ["name", "status", "seconds", "reason"]))
        if failed:
            print(f"failed: {', '.join(failed)} (each record holds the traceback)")
    return 1 if failed else 0
