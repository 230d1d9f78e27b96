"""Stack dumps of every rank of a hung job: faulthandler on a signal, and py-spy.

`dump_stacks` starts a 2-rank job under torchrun that hangs (`hung_rank`: rank 1's data loader
stalls while rank 0 waits in all_reduce), sends SIGUSR2 to every rank (the trainer's guard
registers `faulthandler` on it: each thread's Python stack to standard error, and the rank runs
on), runs `py-spy dump` on each rank where py-spy is installed, and reads the frame each rank
waits in (`parse_faulthandler`, `main_thread`). Then it SIGKILLs the agent and times how fast the
guard's watchdog takes the ranks down.

Chapter: book/failures/hangs.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from .fault_tolerance import alive, children, wait_gone
from .hangs import load_batch


def hung_rank(ready_dir: str, stall_s: float = 120.0) -> None:
    """One rank of a job that hangs, for `dump_stacks` (started by torchrun): rank 1's data
    loader stalls at step 3 while rank 0 waits for it in all_reduce #3. The trainer's guard
    installs the SIGUSR2 stack dump and exits the rank when torchrun's agent dies."""
    from ..train.guard import Guard

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=stall_s))
    rank = dist.get_rank()
    with Guard(rank=rank):
        for step in range(1, 5):
            if step == 3:  # about to hang: tell the parent
                (Path(ready_dir) / f"rank{rank}").touch()
            batch = load_batch(rank, step, stall=(1, 3, stall_s))
            dist.all_reduce(batch)
    dist.destroy_process_group()


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def short(self) -> str:
        path = re.sub(r".*/site-packages/", "", self.file)
        path = re.sub(r".*/code/trainbook/", "trainbook/", path)
        return f"{path}:{self.line} in {self.function}"


def parse_faulthandler(text: str) -> dict[str, list[Frame]]:
    """faulthandler's dump (`Thread 0x... (most recent call first):` then `File "f", line N in
    g` lines) as {thread id: frames, innermost first}; the last dump in `text` wins."""
    threads: dict[str, list[Frame]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):",
                        line.strip())
        if head:
            current = head.group(1)
            threads[current] = []
            continue
        frame = re.match(r'\s+File "(.*)", line (\d+) in (.*)', line)
        if frame and current is not None:
            threads[current].append(Frame(frame.group(1), int(frame.group(2)),
                                          frame.group(3).strip()))
        elif line.strip() and not line.startswith(" "):
            current = None
    return threads


def main_thread(threads: dict[str, list[Frame]]) -> list[Frame]:
    """The frames of the thread that runs the program (its outermost frame is `<module>`)."""
    for frames in threads.values():
        if frames and frames[-1].function == "<module>":
            return frames
    raise ValueError("no main thread in this dump (no frame in <module>); was the dump cut?")


def py_spy() -> str | None:
    """The py-spy executable beside this Python or on PATH, or None (pip install py-spy)."""
    import shutil

    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def dump_stacks(workdir: str | os.PathLike, timeout_s: float = 60) -> dict:
    """Start a 2-rank job that hangs (`hung_rank`) under torchrun, wait until both ranks are in
    place, send SIGUSR2 to every rank (faulthandler's dump, from the guard) and, if installed,
    run `py-spy dump` on each; then SIGKILL the agent and time how fast the guard's watchdog
    takes the ranks down. Returns each rank's dump, its main thread's frames and py-spy's."""
    workdir = Path(workdir).resolve()
    ready, logs = workdir / "ready", workdir / "logs"
    ready.mkdir(parents=True, exist_ok=True)
    code = f"from trainbook.failures.stacks import hung_rank; hung_rank({str(ready)!r})"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "--log-dir", str(logs), "--redirects", "2", "--no-python", sys.executable, "-c",
           code]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(workdir / "agent.log", "w") as agent_log:
        agent = subprocess.Popen(cmd, stdout=agent_log, stderr=subprocess.STDOUT, env=env)
    workers: dict[int, int] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(list(ready.glob("rank*"))) < 2:
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the planted job did not reach its hang: "
                                   + (workdir / "agent.log").read_text()[-2000:])
            time.sleep(0.1)
        time.sleep(0.5)  # rank 0 into all_reduce #3, rank 1 into its stalled loader
        workers = children(agent.pid)
        spy = {}
        for rank, pid in sorted(workers.items()):
            os.kill(pid, signal.SIGUSR2)
            if py_spy():
                spy[rank] = subprocess.run([py_spy(), "dump", "--pid", str(pid)],
                                           capture_output=True, text=True, timeout=30).stdout
        time.sleep(1.0)  # faulthandler writes at once; the redirected log is a plain file
        dumps = {}
        for rank in workers:
            found = sorted(logs.glob(f"*/attempt_0/{rank}/stderr.log"))
            dumps[rank] = found[-1].read_text() if found else ""
        t0 = time.monotonic()
        agent.kill()
        agent.wait(timeout=10)
        gone = wait_gone(list(workers.values()), 10)
        gone_s = None if gone is None else time.monotonic() - t0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)
        for pid in workers.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    return {"pids": workers, "dumps": dumps, "py_spy": spy,
            "stacks": {r: main_thread(parse_faulthandler(d)) for r, d in dumps.items()},
            "workers_gone_s": gone_s,
            "workers_alive": [r for r, p in workers.items() if alive(p)]}


def write_record(path: str | os.PathLike, workdir: str | os.PathLike | None = None) -> Path:
    """Run `dump_stacks` and store what each rank's faulthandler dump and py-spy (where
    installed) said, with the provenance, as JSON: the chapter shows py-spy's view from here
    when the machine that runs it has no py-spy."""
    import tempfile
    from dataclasses import asdict

    import torch

    from ..bench.gpu_truth import header
    from ..bench.gpu_truth import write_record as write_json

    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        r = dump_stacks(Path(workdir or tmp))
    command = (f'python -c "from trainbook.failures import stacks; '
               f'stacks.write_record({str(path)!r})"')
    record = header("hangs-stacks", command, torch.device("cpu"), "small")
    record.update(py_spy_path=py_spy(), py_spy=r["py_spy"], dumps=r["dumps"],
                  stacks={k: [asdict(f) for f in v] for k, v in r["stacks"].items()},
                  workers_gone_s=r["workers_gone_s"])
    return write_json(path.parent, path.stem, record)
