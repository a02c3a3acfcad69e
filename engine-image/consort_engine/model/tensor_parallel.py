"""Tensor parallelism inside one engine pod: `tensor_parallel_size` ranks, one process each.

Rank 0 is the engine's own ModelRunner; ranks 1..N-1 are worker processes that hold their shard of
the weights and KV cache and replay every call rank 0 makes (`execute`, `zero_slots`, ...), so the
collectives inside the forward (an all-reduce after each row-parallel projection) meet. Only rank 0
samples. Attention heads (and KV heads) and the MLP's intermediate dimension are split Megatron
style: q/k/v and gate/up column-parallel, o and down row-parallel; embeddings, norms and the LM head
are replicated (small next to the layers; no gather of logits needed).

Backend: NCCL on CUDA, gloo on CPU (so TP = 2 runs in tests on this machine). Calls reach the
workers as pickled objects over gloo's `broadcast_object_list`, which is fine on CPU and for the
small batch descriptions; tensors never travel that way.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("consort.engine.tp")

TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def split(self, n: int, what: str) -> int:
        """This rank's share of `n` (heads, KV heads, intermediate size): it must divide evenly."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide {what} ({n})")
        return n // self.size

    def rows(self, n_local: int) -> slice:
        return slice(self.rank * n_local, (self.rank + 1) * n_local)


SINGLE = TPGroup()


def all_reduce(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    if group.size > 1:
        dist.all_reduce(x)
    return x


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, size: int, port: int, device: str) -> TPGroup:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=TIMEOUT)
    return TPGroup(rank, size)


def _worker_main(runner_cls: type, config, rank: int, port: int, threads: int) -> None:
    """A rank > 0: load its shard (a runner_cls(config, group): the ModelRunner, passed in because it
    imports this module), then replay rank 0's calls until told to exit."""
    from consort_engine.model.cpu_kernels import set_threads

    set_threads(threads)
    group = init_process_group(rank, config.tensor_parallel_size, port, config.device)
    runner = runner_cls(config, group)
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        method, args = box[0]
        if method == "exit":
            break
        getattr(runner, method)(*args)
    dist.destroy_process_group()


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: start them, send them each call, stop them."""

    def __init__(self, config, runner_cls: type) -> None:
        self.size = config.tensor_parallel_size
        self.port = free_port()
        # Each rank gets an equal share of this process's CPUs for its GEMMs (on CPU).
        self.threads = max(1, torch.get_num_threads() // self.size)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_worker_main, args=(runner_cls, config, r, self.port, self.threads),
                                  daemon=True, name=f"consort-tp-rank{r}") for r in range(1, self.size)]
        for p in self.procs:
            p.start()

    def join_group(self, device: str) -> TPGroup:
        from consort_engine.model.cpu_kernels import set_threads

        set_threads(self.threads)
        return init_process_group(0, self.size, self.port, device)

    def call(self, method: str, *args) -> None:
        dist.broadcast_object_list([(method, args)], src=0)

    def stop(self) -> None:
        try:
            self.call("exit")
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
