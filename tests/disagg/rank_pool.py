"""Worker processes for the P/D tests: two that can be prefill ranks, two that can be decode ranks.

Started once per module (each imports torch and kvplane once) and given a fresh cache, model and side per
test with ``setup``; the two prefill workers and the two decode workers each form a gloo group, so an
instance of TP 2 can all-gather head outputs.
"""

from __future__ import annotations

from pathlib import Path

from framed import FramedProcess

WORKER = Path(__file__).with_name("rank_worker.py")
STARTUP_S = 120.0


def spawn(log: Path) -> FramedProcess:
    proc = FramedProcess([str(WORKER)], log, env={"OMP_NUM_THREADS": "1"})
    proc.read(STARTUP_S)
    return proc


def join_group(workers: list[FramedProcess], init: Path) -> None:
    for rank, w in enumerate(workers):
        w.send(cmd="group", world=len(workers), rank=rank, init_method=f"file://{init}")
    for w in workers:
        reply = w.read(STARTUP_S)
        assert reply == {}, reply


class Pool:
    def __init__(self, tmp: Path) -> None:
        self.prefill = [spawn(tmp / f"prefill{r}.log") for r in range(2)]
        self.decode = [spawn(tmp / f"decode{r}.log") for r in range(2)]
        join_group(self.prefill, tmp / "prefill.group")
        join_group(self.decode, tmp / "decode.group")

    def all(self) -> list[FramedProcess]:
        return self.prefill + self.decode

    def close(self) -> None:
        for w in self.all():
            w.close()
