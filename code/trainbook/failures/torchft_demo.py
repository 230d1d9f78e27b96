"""Per-step fault tolerance with torchft, run on this CPU with gloo: a lighthouse, two replica
groups, one of them SIGKILLed mid-run and restarted.

`run` starts the lighthouse (torchft's Rust server, `torchft_lighthouse`) and two replica groups,
each one process (`replica_main`) that trains the book's model (`trainbook.model.Transformer`,
`TINY`) with torchft's `Manager`, its gloo process group (`torchft.ProcessGroupGloo`), its DDP
wrapper (`torchft.ddp.DistributedDataParallel`) and its optimizer wrapper
(`torchft.optim.OptimizerWrapper`: `zero_grad` asks the lighthouse for the quorum, `step` commits
only if the cross-group all-reduce succeeded). Every iteration of every group is one JSON line:
wall time, the manager's step before and after the quorum and after the commit, how many groups
took part, whether it committed, a sha256 of the weights. Once group 1 has logged `kill_after`
steps it is SIGKILLed; `down_s` seconds later a new process of it starts, joins the next quorum and
receives the weights and optimizer state from group 0 (torchft's live recovery, over HTTP).

`facts` turns a record into the three claims of the chapter: (a) the survivor's step never goes
back and the steps during the outage had one participant; (b) the restarted group's step jumps to
the survivor's and its weights equal the survivor's at that step, bit for bit, and stay equal;
(c) the group-steps lost, against what a global restart from the last checkpoint would lose with
the same measured restart time. Every process runs under a timeout and is stopped by its pid.

Chapter: book/failures/fault-tolerance
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..train.guard import kill_with_parent

# The chapter's model (llama flavour, bytes): a step is some milliseconds of compute.
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128,
        "seq_len": 32, "batch_size": 4}
MEASUREMENT = "fault-tolerance-torchft"


def model_config() -> object:
    """The `ModelConfig` of the replica groups' model (`TINY`)."""
    from ..configs import ModelConfig

    return ModelConfig("torchft-demo", "llama", 256, TINY["n_layers"], TINY["d_model"],
                       TINY["n_heads"], TINY["n_kv_heads"], TINY["d_ff"],
                       max_seq_len=TINY["seq_len"])


def _free_port() -> int:
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                return s.getsockname()[1]
        except OSError:
            continue
    raise OSError("cannot bind a TCP port on this machine for the lighthouse")


def _weights_sha(model: object) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def replica_main(spec_json: str) -> None:
    """One replica group (one process), writing one JSON line per iteration to stdout. It waits
    for the file `go` (if given) before its first step, then trains until the manager's step
    reaches the number in the file `stop` (once it exists) or `max_steps`. `spec_json` holds
    group, lighthouse, timeout_s, step_sleep_s, seed, go, stop, max_steps, deadline (time.time()
    after which it gives up: its own timeout, whatever happens to the process that started it)."""
    import logging
    import warnings
    from datetime import timedelta

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    from ..data import ByteTokenizer, build_dataset
    from ..model import Transformer

    spec = json.loads(spec_json)
    group, timeout = spec["group"], timedelta(seconds=spec["timeout_s"])
    stop, steps = Path(spec["stop"]), spec["max_steps"]
    torch.manual_seed(spec["seed"])
    torch.set_num_threads(1)
    model = Transformer(model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    blocks = build_dataset(ByteTokenizer(), TINY["seq_len"]).train

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=1, use_async_quorum=False,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                      rank=0, world_size=1, store_addr="localhost", store_port=store.port,
                      lighthouse_addr=spec["lighthouse"], replica_id=f"group_{group}")
    ddp = DistributedDataParallel(manager, model)
    optim = OptimizerWrapper(manager, opt)
    print(json.dumps({"group": group, "event": "ready", "t": time.time(),
                      "pid": os.getpid()}), flush=True)
    t_end = time.monotonic() + spec["timeout_s"]
    while spec["go"] and not Path(spec["go"]).exists():  # start both groups together
        if time.monotonic() > t_end:
            raise TimeoutError(f"{spec['go']} did not appear in {spec['timeout_s']} s")
        time.sleep(0.01)
    it = 0
    while manager.current_step() < (int(stop.read_text()) if stop.exists() else steps):
        before = manager.current_step()
        optim.zero_grad()  # quorum; a restarted group is healed here, before its forward
        after_quorum = manager.current_step()
        healed_sha = _weights_sha(model) if after_quorum != before else None
        g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + 2 * after_quorum + group)
        rows = torch.randint(len(blocks), (TINY["batch_size"],), generator=g)
        x, y = blocks[rows, :-1], blocks[rows, 1:]
        _, loss = ddp(x, y)
        loss.backward()
        optim.step()  # commits only if every participant's all-reduce succeeded
        step = manager.current_step()
        print(json.dumps({"group": group, "iter": it, "t": time.time(),
                          "before": before, "after_quorum": after_quorum, "step": step,
                          "committed": step == after_quorum + 1,
                          "participants": manager.num_participants(),
                          "quorum_id": manager._quorum_id, "loss": float(loss),
                          "healed_sha": healed_sha, "sha": _weights_sha(model)}), flush=True)
        it += 1
        time.sleep(spec["step_sleep_s"])
        if time.time() > spec["deadline"]:
            raise TimeoutError(f"group {group} passed its deadline at step {step}")
    manager.shutdown(wait=False)


class _Proc:
    """A child process with stdout (JSON lines) and stderr in files; killed by pid on stop."""

    def __init__(self, argv: list[str], out: Path, env: dict[str, str]):
        self.out, self.err = out, out.with_suffix(".err")
        with open(self.out, "w") as o, open(self.err, "w") as e:
            # the kernel SIGKILLs it if this process dies first (Linux), so nothing outlives us
            self.proc = subprocess.Popen(argv, stdout=o, stderr=e, env=env,
                                         preexec_fn=kill_with_parent)
        self.pid, self.started = self.proc.pid, time.time()

    def records(self) -> list[dict]:
        lines = self.out.read_text().splitlines() if self.out.exists() else []
        out = []
        for ln in lines:
            try:
                out.append(json.loads(ln))
            except json.JSONDecodeError:
                pass  # a line being written
        return out

    def steps(self) -> list[dict]:
        return [r for r in self.records() if "iter" in r]

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)
        self.proc.wait(timeout=30)


def _replica_argv(spec: dict) -> list[str]:
    code = ("from trainbook.failures.torchft_demo import replica_main; "
            f"replica_main({json.dumps(spec)!r})")
    return [sys.executable, "-u", "-c", code]


def _check(kill_after: int, after_rejoin: int, down_s: float, timeout_s: float) -> None:
    for name, v in (("kill_after", kill_after), ("after_rejoin", after_rejoin)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be at least 1 step, got {v}")
    for name, v in (("down_s", down_s), ("timeout_s", timeout_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a number of seconds, got {type(v).__name__}")
    if not 0 < timeout_s:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if not 0 <= down_s < timeout_s:
        raise ValueError(f"down_s={down_s} must be >= 0 and below timeout_s={timeout_s}")


def run(workdir: str | os.PathLike, kill_after: int = 20, after_rejoin: int = 10,
        down_s: float = 1.0, step_sleep_s: float = 0.1, timeout_s: float = 180.0,
        heartbeat_timeout_ms: int = 1000, join_timeout_ms: int = 500) -> dict:
    """Lighthouse and two replica groups, started together; SIGKILL group 1 once it has logged
    step `kill_after`, start it again `down_s` s later, and stop both `after_rejoin` steps after
    it rejoined. Returns every process's per-iteration log (times in seconds from the
    lighthouse's start) and the events. TimeoutError, after killing everything by pid, if the
    run takes longer than `timeout_s`."""
    _check(kill_after, after_rejoin, down_s, timeout_s)
    work = Path(workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    go, stop = work / "go", work / "stop"
    for f in (go, stop):
        f.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    port = _free_port()
    lh_argv = [str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "1",
               "--bind", f"[::]:{port}", "--join_timeout_ms", str(join_timeout_ms),
               "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
    spec = {"lighthouse": f"http://localhost:{port}", "timeout_s": min(60, timeout_s),
            "step_sleep_s": step_sleep_s, "seed": 0, "go": str(go), "stop": str(stop),
            "max_steps": 100_000, "deadline": time.time() + timeout_s + 10}
    procs: list[_Proc] = []
    target = [10**9]
    deadline = time.monotonic() + timeout_s

    def wait_until(cond, what: str, expected_dead: tuple = ()) -> None:
        while not cond():
            for p in procs:
                if p.proc.poll() is not None and p not in expected_dead and not done(p):
                    raise RuntimeError(f"{p.out.name} exited {p.proc.returncode} before "
                                       f"{what}:\n{p.err.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the torchft demo did not reach {what} in {timeout_s:.0f} s")
            time.sleep(0.01)

    def done(p: _Proc) -> bool:
        s = p.steps()
        return p.proc.poll() is not None and bool(s) and s[-1]["step"] >= target[0]

    events: dict = {}
    t0 = time.time()
    try:
        lh = _Proc(lh_argv, work / "lighthouse.out", env)
        g0 = _Proc(_replica_argv({**spec, "group": 0}), work / "group0.out", env)
        g1 = _Proc(_replica_argv({**spec, "group": 1}), work / "group1.out", env)
        procs += [lh, g0, g1]
        wait_until(lambda: all(any(r.get("event") == "ready" for r in p.records())
                               for p in (g0, g1)), "both groups ready")
        go.touch()
        events["go_t"] = time.time() - t0
        wait_until(lambda: any(r["step"] >= kill_after for r in g1.steps()),
                   f"group 1 step {kill_after}")
        g1.stop(signal.SIGKILL)
        events["kill_t"] = time.time() - t0
        events["killed_last_step"] = g1.steps()[-1]["step"]
        events["survivor_step_at_kill"] = g0.steps()[-1]["step"]
        time.sleep(down_s)
        g1b = _Proc(_replica_argv({**spec, "group": 1, "go": ""}),
                    work / "group1-restarted.out", env)
        procs.append(g1b)
        events["restart_t"] = time.time() - t0
        wait_until(lambda: any(r["participants"] == 2 and r["committed"] for r in g1b.steps()),
                   "the rejoin", expected_dead=(g1,))
        target[0] = max(p.steps()[-1]["step"] for p in (g0, g1b)) + after_rejoin
        tmp = stop.with_suffix(".tmp")
        tmp.write_text(str(target[0]))
        os.replace(tmp, stop)
        wait_until(lambda: done(g0) and done(g1b), f"step {target[0]} in both groups",
                   expected_dead=(g1,))
        for p in (g0, g1b):
            if p.proc.returncode != 0:
                raise RuntimeError(f"{p.out.name} exited {p.proc.returncode}:\n"
                                   f"{p.err.read_text()[-3000:]}")
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGKILL)
    events["lighthouse_exit"] = lh.proc.returncode  # -9: stopped by us, it did not die itself
    rel = lambda rs: [{**r, "t": r["t"] - t0} for r in rs if "iter" in r]  # noqa: E731
    names = {"group0": g0, "group1": g1, "group1_restarted": g1b}
    return {"kill_after": kill_after, "after_rejoin": after_rejoin, "down_s": down_s,
            "final_step": target[0], "step_sleep_s": step_sleep_s,
            "heartbeat_timeout_ms": heartbeat_timeout_ms, "join_timeout_ms": join_timeout_ms,
            "lighthouse_argv": lh_argv[1:], "model": TINY,
            "pids": {"lighthouse": lh.pid, **{k: p.pid for k, p in names.items()}},
            "ready_t": {k: next(r["t"] - t0 for r in p.records() if r.get("event") == "ready")
                        for k, p in names.items()},
            **events, "log": {k: rel(p.records()) for k, p in names.items()}}


def facts(record: dict, ckpt_every: int = 25) -> dict:
    """The chapter's claims, computed from a `run` record. `ckpt_every`: the checkpoint interval
    of the global-restart job it is compared with (which rolls back to its last checkpoint and
    waits for the same measured restart time with every group idle)."""
    if isinstance(ckpt_every, bool) or not isinstance(ckpt_every, int) or ckpt_every < 1:
        raise ValueError(f"ckpt_every must be a positive int (steps), got {ckpt_every!r}")
    if not isinstance(record, dict) or "log" not in record:
        raise TypeError("record must be the dict that torchft_demo.run returned (with a 'log')")
    surv, dead, back = (record["log"][k] for k in ("group0", "group1", "group1_restarted"))
    kill_t = record["kill_t"]
    rejoin = next(r for r in back if r["committed"])
    by_step = {r["step"]: r for r in surv if r["committed"]}
    # (a) one process, its step never goes back, outage steps had one participant
    monotonic = all(b["before"] == a["step"] and b["step"] >= b["before"]
                    for a, b in zip(surv, surv[1:]))
    heal_step = rejoin["after_quorum"]
    outage = [r for r in surv if r["t"] > kill_t and r["step"] <= heal_step]
    aborted = [r for r in surv if not r["committed"]]
    # (b) the restarted group's step jumps to the survivor's; its weights equal the survivor's
    healed_equal = rejoin["healed_sha"] == by_step[heal_step]["sha"]
    after_equal = all(by_step[r["step"]]["sha"] == r["sha"] for r in back if r["committed"])
    before_equal = all(by_step[r["step"]]["sha"] == r["sha"] for r in dead if r["committed"])
    # (c) the lost work, in group-steps (one group's step: one batch of one replica)
    two = [b["t"] - a["t"] for a, b in zip(surv, surv[1:])
           if a["participants"] == 2 and b["participants"] == 2 and b["t"] < kill_t]
    step_s = sorted(two)[len(two) // 2]
    window = surv[-1]["t"] - surv[0]["t"] + step_s
    committed = sum(r["participants"] for r in surv if r["committed"])
    lost_ft = 2 * window / step_s - committed
    restart_s = rejoin["t"] - kill_t
    rollback = record["survivor_step_at_kill"] % ckpt_every
    lost_global = 2 * (restart_s / step_s + rollback)
    gaps = [b["t"] - a["t"] for a, b in zip(surv, surv[1:])]
    return {"survivor_monotonic": monotonic, "survivor_iterations": len(surv),
            "outage_steps": len(outage),
            "outage_one_participant": bool(outage) and all(
                r["participants"] == 1 for r in outage if r["committed"]),
            "aborted_steps": len(aborted), "survivor_stall_s": max(gaps),
            "killed_at_step": record["killed_last_step"], "heal_step": heal_step,
            "restarted_first_before": rejoin["before"],
            "rejoin_step": rejoin["step"],
            "rejoin_step_joint": by_step[rejoin["step"]]["participants"] == 2,
            "healed_weights_equal": healed_equal, "weights_equal_after": after_equal,
            "weights_equal_before_kill": before_equal, "final_step": surv[-1]["step"],
            "step_s": step_s, "restart_s": restart_s, "group_steps_committed": committed,
            "lost_group_steps_torchft": lost_ft, "ckpt_every": ckpt_every,
            "rollback_steps": rollback, "lost_group_steps_global": lost_global}


def write_record(path: str | os.PathLike, **kwargs: object) -> Path:
    """Run `run` once (keyword arguments passed on) and store it as JSON with its provenance
    (command, date, versions of torch and torchft)."""
    import tempfile
    from importlib.metadata import version

    import torch

    from ..bench.gpu_truth import header
    from ..bench.gpu_truth import write_record as write_json

    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(f"path must end in .json, got {str(path)!r}")
    with tempfile.TemporaryDirectory() as tmp:
        rec = run(tmp, **kwargs)
    command = (f'python -c "from trainbook.failures import torchft_demo; '
               f'torchft_demo.write_record({str(path)!r})"')
    record = header(MEASUREMENT, command, torch.device("cpu"), "small")
    record["versions"]["torchft"] = version("torchft")
    record.update(rec)
    return write_json(path.parent, path.stem, record)


def read_record(path: str | os.PathLike) -> dict:
    """A record `write_record` stored."""
    from ..bench.gpu_truth import read_record as read_stored

    return read_stored(path, MEASUREMENT, "torchft_demo.write_record")
