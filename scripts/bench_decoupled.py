"""Decoupled (FlowTrain) training vs the encoder inside pipeline stage 0, under encoder jitter;
and the pool's put-to-get latency per backend.

Part 1 runs real processes over gloo with the runtime: a trainable encoder and a two-stage
backbone whose compute is *injected* time (sleeps of a fixed budget per action, so two
CPU cores can host four ranks without the ranks competing).  The encoder's forward takes
``--encoder-ms`` times a normal factor (sd ``--jitter``), and with probability
``--spike-prob`` a spike ``--spike-x`` times longer; its backward takes twice that.  The
same per-microbatch draws are used by every layout:

- ``stage0`` (named baseline): Megatron/MindSpeed-MM's layout, the encoder inside pipeline
  stage 0 of the 1F1B pipeline (2 ranks);
- ``decoupled-1`` / ``decoupled-2``: the encoder on 1 / 2 ranks of its own, feeding the
  same 1F1B pipeline through the pool (3 / 4 ranks; ``--pool`` backend).

It reports the measured step time (best of ``--steps`` after a warm-up step), the
backbone's idle fraction (1 - busy compute time / step time on the backbone ranks), the
device-seconds per step, and ratios against ``stage0`` measured in the same run.

Part 2 measures the pool's put-to-get latency: a producer puts an object, a consumer
waiting in ``get`` on another process (thread for ``local``) returns it; latency is the
consumer's return time minus the producer's put start (same node, same clock), median of
``--repeats``, for 1 MB and 64 MB objects on every backend that can run here.

    python scripts/bench_decoupled.py            # both parts, prints tables
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import statistics
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm import tqdm

from mindspeed_flow.loopback import tcp_store_server
from mindspeed_flow.pool import open_pool
from mindspeed_flow.pool.availability import backend_status
from mindspeed_flow.pool.mooncake import OPT_IN_ENV, listen_opt_in
from mindspeed_flow.decoupled import DecoupledLayout
from mindspeed_flow.runtime import Binding, Executor, RuntimeOptions, WaitPolicy
from mindspeed_flow.schedule import OneFOneB, Region, compose

DIM = 16
COMPUTE_KINDS = ("F", "B", "I", "W")


# ----------------------------------------------------------------------------- workload


class Busy(torch.autograd.Function):
    """Identity whose forward and backward each take an injected number of seconds."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class Part(nn.Module):
    """One model chunk: a linear layer plus injected time per microbatch (``cost(m)`` is
    its forward seconds; backward is twice that).  The first chunk of the model reads the
    microbatch's input; the others take theirs through ``set_input_tensor``."""

    def __init__(self, cost: Callable[[int], float], first: bool) -> None:
        super().__init__()
        self.layer = nn.Linear(DIM, DIM)
        self.cost, self.first = cost, first
        self.input: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list) -> None:
        self.input = tensors[0]

    def forward(self, batch: dict) -> torch.Tensor:
        x = batch["x"] if self.first else self.input
        seconds = self.cost(batch["m"])
        return Busy.apply(torch.tanh(self.layer(x)), seconds, 2 * seconds)


def encoder_costs(args: argparse.Namespace) -> list[float]:
    """Forward seconds of the encoder per microbatch: normal jitter plus rare long spikes."""
    g = torch.Generator().manual_seed(args.seed)
    costs = []
    for _ in range(args.microbatches):
        factor = max(0.2, 1.0 + args.jitter * float(torch.randn((), generator=g)))
        if float(torch.rand((), generator=g)) < args.spike_prob:
            factor *= args.spike_x
        costs.append(args.encoder_ms / 1000 * factor)
    return costs


def batches(count: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"x": torch.randn(8, DIM, generator=g), "m": m} for m in range(count)]


def forward_step(data_iterator, model):
    def loss_func(output):
        loss = output.pow(2).mean()
        return loss, {"loss": loss.detach()}

    return model(next(data_iterator)), loss_func


# ----------------------------------------------------------------------------- layouts


def layout_plan(layout: str, microbatches: int):
    """(plan, role of each rank: (region, stage), backbone ranks)."""
    if layout == "stage0":
        skeleton = OneFOneB(stages=2, layers=(2, 1))
        plan = compose([Region("vit", 1, skeleton), Region("llm", 2, skeleton)], microbatches)
        return plan, [[("vit", 0), ("llm", 0)], [("llm", 1)]], [0, 1]
    decoupled = DecoupledLayout(encoder_dp=int(layout.split("-")[1]), backbone_pp=2, max_ahead=4)
    roles = [[decoupled.role(r).binding] for r in range(decoupled.world_size)]
    return decoupled.plan(microbatches), roles, decoupled.backbone_ranks


def training_worker(rank: int, world: int, args: argparse.Namespace, layout: str, name: str) -> dict:
    plan, roles, backbone = layout_plan(layout, args.microbatches)
    costs = encoder_costs(args)
    stage_s = args.stage_ms / 1000
    torch.manual_seed(0)
    modules = {"vit": Part(lambda m: costs[m], first=True), "llm0": Part(lambda m: stage_s, first=False),
               "llm1": Part(lambda m: stage_s, first=False)}
    pool = None
    if plan_uses_pool(plan):
        options: dict = {"name": name, "timeout_s": 120}
        if args.pool != "torch":
            options["owner"] = f"rank{rank}"
        if args.pool == "mooncake":
            options.update(args.mooncake)
        pool = open_pool(args.pool, capacity_bytes=1 << 22, **options)
    executor = Executor(rank, list(range(world)), pool=pool, options=RuntimeOptions(wait=WaitPolicy(timeout_s=120)))
    steps = []
    for _ in range(args.steps + 1):
        data = iter(batches(args.microbatches))
        bindings = {(region, stage): Binding(modules["vit" if region == "vit" else f"llm{stage}"], data)
                    for region, stage in roles[rank]}
        torch.distributed.barrier()
        start = time.monotonic()
        result = executor.run(plan, forward_step, bindings)
        torch.distributed.barrier()
        step = time.monotonic() - start
        busy = sum(s.end - s.start for s in result.timeline.stamps if s.action.kind.value in COMPUTE_KINDS)
        steps.append({"step_s": step, "busy_s": busy})
    if pool is not None:
        torch.distributed.barrier()
        pool.close()
    return {"steps": steps[1:], "backbone": rank in backbone}


def plan_uses_pool(plan) -> bool:
    return any(a.kind.value in ("PUT", "GET") for p in plan.programs.values() for a in p)


def summarize(ranks: list[dict], world: int) -> dict:
    """Best step (by the slowest rank's time) and the backbone's idle fraction in it."""
    per_step = list(zip(*[r["steps"] for r in ranks]))
    best = min(per_step, key=lambda step: max(s["step_s"] for s in step))
    step_s = max(s["step_s"] for s in best)
    idle = [1 - s["busy_s"] / step_s for s, r in zip(best, ranks) if r["backbone"]]
    return {"step_s": step_s, "backbone_idle": statistics.mean(idle), "ranks": world,
            "device_s": step_s * world}


# ----------------------------------------------------------------------------- processes


def launch(worker: Callable, world: int, *args: Any, timeout_s: float = 600) -> list[Any]:
    """``worker(rank, world, *args)`` in ``world`` spawned processes of one gloo group on
    127.0.0.1; results by rank.  Every process is stopped before this returns."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = tcp_store_server(world, timeout=timedelta(seconds=timeout_s))  # listens on 127.0.0.1 only
    procs = [ctx.Process(target=_child, args=(rank, world, store.port, worker, args, results), daemon=True)
             for rank in range(world)]
    try:
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < world:
            try:
                rank, error, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(out))} gave no result in {timeout_s} s")
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            out[rank] = value
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _child(rank: int, world: int, port: int, worker: Callable, args: tuple, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets on loopback too
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=600))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
        results.put((rank, None, worker(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the rank
        results.put((rank, traceback.format_exc(), None))


# ----------------------------------------------------------------------------- latency


def latency_worker(rank: int, world: int, backend: str, sizes: list[int], repeats: int, options: dict) -> list:
    """Rank 0 puts, rank 1 gets; per size the put-to-get seconds of each repeat."""
    opts = {**options, "timeout_s": 120}
    if backend != "torch":
        opts["owner"] = f"rank{rank}"
    pool = open_pool(backend, capacity_bytes=2 * max(sizes) + (1 << 20), **opts)
    out = []
    for size in sizes:
        tensor = torch.randint(0, 255, (size,), dtype=torch.uint8)
        for i in range(repeats):
            key = f"lat/{size}/{i}"
            torch.distributed.barrier()
            if rank == 0:
                pool.put(key, tensor, {"t": time.time()})
            else:
                handle = pool.handle(key, timeout=60)
                got = pool.get(handle)
                out.append((size, time.time() - handle.meta["t"]))
                assert got.numel() == size
                pool.release(key)
    torch.distributed.barrier()
    pool.close()
    return out


def local_latency(sizes: list[int], repeats: int) -> list:
    """The ``local`` backend: producer and consumer are threads of this process."""
    out = []
    name = f"bench-lat-{os.getpid()}"
    consumer = open_pool("local", capacity_bytes=1 << 20, name=name, owner="consumer")
    for size in sizes:
        tensor = torch.randint(0, 255, (size,), dtype=torch.uint8)
        producer: dict = {}

        def produce() -> None:
            producer["pool"] = open_pool("local", capacity_bytes=2 * size, name=name, owner="producer")
            for i in range(repeats):
                consumer_ready.wait()
                consumer_ready.clear()
                producer["pool"].put(f"lat/{size}/{i}", tensor, {"t": time.time()})
            done.wait()

        consumer_ready, done = threading.Event(), threading.Event()
        thread = threading.Thread(target=produce)
        thread.start()
        for i in range(repeats):
            consumer_ready.set()
            handle = consumer.handle(f"lat/{size}/{i}", timeout=60)
            consumer.get(handle)
            out.append((size, time.time() - handle.meta["t"]))
            consumer.release(handle.key)
        done.set()
        thread.join()
        producer["pool"].close()
    consumer.close()
    return out


def measure_latency(args: argparse.Namespace) -> dict:
    sizes = [1 << 20, 64 << 20]
    table: dict = {}
    status = backend_status()
    if status["mooncake"] is None and not args.mooncake:
        status["mooncake"] = (f"not opted in: a Mooncake client listens beyond loopback; set {OPT_IN_ENV}=1 "
                              "to measure it (docs/pool.md)")
    for backend in tqdm(["local", "shm", "torch", "mooncake"], desc="pool latency"):
        if status[backend] is not None:
            table[backend] = f"cannot run here: {status[backend]}"
            continue
        if backend == "local":
            samples = local_latency(sizes, args.repeats)
        else:
            options = {"name": f"bench-lat-{os.getpid()}-{backend}"}
            if backend == "mooncake":
                options.update(args.mooncake)
            samples = launch(latency_worker, 2, backend, sizes, args.repeats, options)[1]
        table[backend] = {f"{size >> 20} MB": statistics.median(s for n, s in samples if n == size)
                          for size in sizes}
    return table


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="measured steps (after one warm-up step)")
    parser.add_argument("--encoder-ms", type=float, default=20.0, help="encoder forward time per microbatch")
    parser.add_argument("--stage-ms", type=float, default=15.0, help="backbone stage forward time per microbatch")
    parser.add_argument("--jitter", type=float, default=0.2, help="sd of the encoder's normal time factor")
    parser.add_argument("--spike-prob", type=float, default=0.15)
    parser.add_argument("--spike-x", type=float, default=5.0, help="how many times longer a spike is")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pool", default="shm", help="pool backend of the decoupled layouts")
    parser.add_argument("--repeats", type=int, default=5, help="latency samples per size")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)

    server = None
    args.mooncake = {}
    if backend_status()["mooncake"] is None and listen_opt_in(None):
        from mindspeed_flow.pool.mooncake import MooncakeServer

        server = MooncakeServer()
        args.mooncake = {**server.options, "listen_beyond_loopback": True}
    try:
        costs = encoder_costs(args)
        spikes = sum(c > args.encoder_ms / 1000 * 2 for c in costs)
        print(f"encoder forward ms per microbatch: {[round(c * 1000) for c in costs]} ({spikes} spikes)")
        training = {}
        for layout in tqdm(["stage0", "decoupled-1", "decoupled-2"], desc="layouts"):
            plan, roles, _ = layout_plan(layout, args.microbatches)
            world = len(roles)
            ranks = launch(training_worker, world, args, layout, f"bench-{os.getpid()}-{layout}")
            training[layout] = summarize(ranks, world)
        base = training["stage0"]
        print(f"\n{'layout':<12} {'ranks':>5} {'step s':>8} {'backbone idle':>14} {'device s':>9} "
              f"{'step vs stage0':>15}")
        for layout, row in training.items():
            print(f"{layout:<12} {row['ranks']:>5} {row['step_s']:>8.3f} {row['backbone_idle']:>14.1%} "
                  f"{row['device_s']:>9.3f} {base['step_s'] / row['step_s']:>14.2f}x")
        latency = {} if args.skip_latency else measure_latency(args)
        if latency:
            print("\npool put-to-get latency (median, ms):")
            for backend, row in latency.items():
                text = row if isinstance(row, str) else "  ".join(f"{k}: {v * 1000:8.2f}" for k, v in row.items())
                print(f"  {backend:<9} {text}")
        if args.json:
            args.json.write_text(json.dumps({"training": training, "latency": latency,
                                             "config": {k: v for k, v in vars(args).items()
                                                        if k not in ("json", "mooncake")}}, indent=1))
    finally:
        if server is not None:
            server.stop()
        from mindspeed_flow.pool.shm import destroy

        destroy(f"bench-{os.getpid()}")
        destroy(f"bench-lat-{os.getpid()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
