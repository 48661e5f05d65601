"""One rank of the 2-process gloo runs of test_distributed.py: ``python dist_worker.py all|die OUT``.

The environment is torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), set by the test. Rank 0
writes what the test compares to OUT (JSON); every rank checks that the others hold the same."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import dptune
from dptune.distributed import BroadcastNoise, RankLost, ReducingRelease, ShardedSampler, join
from dptune.errors import ConfigError
from dptune.release.ledger import Ledger
from dptune.release.mechanisms import SumQuery
from dptune.release.sampling import PoissonSampler


def data(n: int = 120) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)  # float64: reassociation far below the tolerance
    return x, (x[:, 0] + 0.3 * torch.randn(n, generator=g, dtype=torch.float64) > 0).long()


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # a different start on each rank: rank 0's is broadcast
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


RUNS = {  # strategy → its hyperparameters: the plain release, quantile's count, OSO's deferred query, DP-ZO's directions
    "dpsgd": {"clip": 0.5, "lr": 0.5, "momentum": 0.0},
    "quantile": {},
    "dpzo": {},
    "oso": {},
}


def train_runs(rank: int, world: int) -> dict:
    out = {}
    for name, hps in RUNS.items():
        r = dptune.train(model(rank), data(), name, steps=6, expected_batch_size=40, noise_multiplier=1.3,
                         delta=1e-3, eval_data=data(40), eval_public=True, eval_every=3, seed=11,
                         distributed=True, **hps)  # fmt: skip
        out[name] = {
            "params": {k: v.tolist() for k, v in r.final_params.items()},
            "ledger": r.ledger.to_dict(),
            "evals": r.evals,
        }
    return out


def batches(rank: int, world: int) -> dict:
    """The union of the shards, step by step, next to one process's Poisson batches (same seed)."""
    mine, alone = ShardedSampler(100, 0.2, seed=3), PoissonSampler(100, 0.2, seed=3)
    steps = []
    for _ in range(20):
        shards: list = [None] * world
        dist.all_gather_object(shards, mine.sample().tolist())
        steps.append({"union": sorted(i for s in shards for i in s), "alone": alone.sample().tolist(),
                      "disjoint": len({i for s in shards for i in s}) == sum(map(len, shards))})  # fmt: skip
    return {"steps": steps}


def secure_and_mismatch(rank: int, world: int) -> dict:
    """Secure mode (rank 0's OS CSPRNG, broadcast): every rank ends with the same parameters. Then ranks
    that planned different runs (T = 3 vs 4) are refused, on every rank, before anything is released."""
    kw = dict(expected_batch_size=40, noise_multiplier=1.3, distributed=True, clip=0.5, lr=0.5, momentum=0.0)
    r = dptune.train(model(rank), data(), "dpsgd", steps=4, secure_mode=True, **kw)
    every: list = [None] * world
    dist.all_gather_object(every, {k: v.tolist() for k, v in r.final_params.items()})
    refused = {}
    other = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    x, y = data()
    swapped = torch.arange(len(y))
    swapped[[2, 4]] = swapped[[4, 2]] if rank else swapped[[2, 4]]  # rows no sample of 64 rows reads (review)
    for what, net, rows, steps in [
        ("plan", model(rank), data(), 3 + rank),
        ("rows", model(rank), data() if rank == 0 else tuple(t.flip(0) for t in data()), 3),  # found in review
        ("rows_map", model(rank), TensorDataset(x[swapped], y[swapped]), 3),
        ("model", model(rank) if rank == 0 else other, data(), 3),
    ]:
        try:
            dptune.train(net, rows, "dpsgd", steps=steps, **kw)
            refused[what] = ""
        except ConfigError as e:
            refused[what] = str(e)
    torch.manual_seed(rank)  # a buffer outside the state_dict, drawn differently on each rank: rank 0's is used
    projected = Projected()
    dptune.train(projected, data(), "dpsgd", steps=2, **kw)
    buffers: list = [None] * world
    dist.all_gather_object(buffers, projected.proj.tolist())
    return {"secure_same_on_every_rank": all(e == every[0] for e in every), "refused": refused,
            "buffer_same_on_every_rank": all(b == buffers[0] for b in buffers)}  # fmt: skip


class Projected(torch.nn.Module):
    """A random projection kept out of the state_dict (``persistent=False``), then ``model``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("proj", torch.randn(5, 5, dtype=torch.float64), persistent=False)
        self.net = model(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x @ self.proj)


def noise(rank: int, world: int) -> dict:
    """Two releases of a zero sum (1,000 coordinates) through the rank's gateway: noise drawn once has std ν·s."""
    ledger = Ledger()
    gateway = ReducingRelease(ledger, 0.5, BroadcastNoise(seed=5 + rank))  # rank 1's own stream is never read
    z = torch.cat([gateway.release(SumQuery("g", torch.zeros(1000), 1.0, 2.0), label="g")[0] for _ in range(2)])
    every: list = [None] * world
    dist.all_gather_object(every, z.tolist())
    return {"z": z.tolist(), "same_on_every_rank": all(e == every[0] for e in every), "releases": ledger.releases}


def die(rank: int, world: int) -> dict:
    """Rank 1 stops after its third step; rank 0 must stop cleanly at its next collective."""
    x, y = data()
    net = model(0)
    private = dptune.make_private(net, (x, y), torch.optim.SGD(net.parameters(), lr=0.1), steps=10,
                                  expected_batch_size=30, noise_multiplier=1.0, seed=1, distributed=True)  # fmt: skip
    t = 0
    try:
        for bx, by in private.batches():
            private.step(bx, by)
            t += 1
            if rank == 1 and t == 3:
                os._exit(3)
    except RankLost as e:
        return {"error": str(e), "steps": t, "releases": private.ledger.releases}
    return {"error": None, "steps": t}


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    join("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "die":
        result = die(rank, world)
    else:  # one start of two processes for the rest
        result = {"train": train_runs(rank, world), "batches": batches(rank, world), "noise": noise(rank, world),
                  "secure": secure_and_mismatch(rank, world)}  # fmt: skip
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if mode != "die":
        dist.barrier()  # neither rank tears gloo down while the other still talks (an abort at exit, under load)
        dist.destroy_process_group()
    # Gloo's threads can still abort the interpreter's own teardown under load ("terminate called without an
    # active exception", rank 1, 1 full suite in 3): everything is written and torn down by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
