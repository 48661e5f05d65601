"""Data-parallel private training on ``torch.distributed``: one run on N processes, the same algorithm
(``train``/``make_private`` with ``distributed=True``, the default under ``torchrun``: ``launched``).
``train.open_run`` swaps the run's three random or private parts: ``ShardedSampler`` (rank 0 draws the one Poisson
batch, rank r keeps ``r::N``), ``ReducingRelease`` (every query's exact sum all-reduced BEFORE the event is recorded),
``BroadcastNoise`` (drawn once on rank 0, broadcast). A lost rank or a collective past ``DPTUNE_DIST_TIMEOUT`` raises
``RankLost`` before anything is recorded (docs/privacy.md, item 10)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dptune.devices import resolve_device
from dptune.errors import ConfigError, DPTuneError
from dptune.release.context import RunPlan
from dptune.release.mechanisms import DeferredSum, NoiseSource, NoisyRelease, SumQuery
from dptune.release.sampling import PoissonSampler
from dptune.tree import Accumulated, Tensors

TIMEOUT_S = 300.0  # default of DPTUNE_DIST_TIMEOUT: how long a collective waits for a lost rank


class RankLost(DPTuneError):
    """A process of a distributed run stopped or timed out: the run stops on every rank."""


def launched() -> bool:
    """Is this process one of several: started by ``torchrun`` (its WORLD_SIZE and MASTER_ADDR), or in a
    process group of more than one already initialised (``mp.spawn``: each rank would otherwise run a whole
    private run of its own, N runs spending N·ε; found in review)?"""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ:
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """The process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def writes() -> bool:
    """Does this process write a run's files (rank 0, or no process group)?"""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def join(device: Any = None) -> torch.device:
    """Join the process group ``torchrun`` describes (env://) unless one is already initialised; return this rank's
    device (``cuda`` → ``cuda:LOCAL_RANK``, modulo the GPUs present). Backend: NCCL on CUDA, gloo on the CPU;
    ``DPTUNE_DIST_BACKEND`` overrides (gloo where NCCL refuses two ranks on one GPU)."""
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if dist.is_available() and dist.is_initialized():
        return dev
    if not dist.is_available() or "MASTER_ADDR" not in os.environ:
        raise ConfigError(
            "distributed=True needs a process group: none is initialised and no torchrun environment "
            "(MASTER_ADDR, RANK, WORLD_SIZE) is set. Fix: launch with `torchrun --nproc-per-node N script.py`, "
            "or call torch.distributed.init_process_group first."
        )
    backend = os.environ.get("DPTUNE_DIST_BACKEND") or ("nccl" if dev.type == "cuda" else "gloo")
    seconds = os.environ.get("DPTUNE_DIST_TIMEOUT", str(TIMEOUT_S))
    if not seconds.replace(".", "", 1).isdigit() or not 0 < float(seconds) < 1e9:
        raise ConfigError("DPTUNE_DIST_TIMEOUT must be a number of seconds > 0. Fix: e.g. DPTUNE_DIST_TIMEOUT=300.")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=float(seconds)))
    except RuntimeError as e:  # DistStoreError: the other ranks never joined (found in review: a traceback)
        raise RankLost(
            f"the process group did not start ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            "Fix: launch every rank with torchrun, or unset WORLD_SIZE/MASTER_ADDR for a one-process run."
        ) from e
    return dev


def _collective(op: Any, t: torch.Tensor, what: str) -> torch.Tensor:
    """``op`` (all_reduce or broadcast from rank 0) on ``t``, on the backend's device; ``RankLost`` when
    a peer is gone. Returns the result on ``t``'s device."""
    comm = t.to(torch.device("cuda", torch.cuda.current_device())) if dist.get_backend() == "nccl" else t.cpu()
    comm = comm.clone() if comm is t else comm
    try:
        op(comm) if op is dist.all_reduce else op(comm, src=0)
    except RuntimeError as e:  # gloo/NCCL: a closed connection or a timeout (DistBackendError too)
        raise RankLost(
            f"a process of the distributed run stopped or timed out during the {what} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Nothing of this step was released; the run stops. "
            "Fix: find why that rank stopped (its own error output), then start the run again."
        ) from e
    return comm.to(t.device)


def sync_model(model: torch.nn.Module, data_digest: str) -> None:
    """Every rank starts from rank 0's parameters and buffers (public: the model before training), once all
    hold the same model (names, shapes, dtypes, trainable, module types) and data (``OwnTask.digest``): a
    rank with its rows in another order clipped one example twice a step (2C, accounted as C), one with a
    float64 model received half the noise vector (gloo accepts a short message; found in review)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    shape = repr(([(k, tuple(v.shape), v.dtype, v.requires_grad) for k, v in tensors], [*map(type, model.modules())]))
    mine = (hashlib.sha256(shape.encode()).hexdigest(), data_digest)
    every: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(every, mine)
    except RuntimeError as e:  # a rank that stopped before the start (its own error says why)
        raise RankLost(f"a process of the distributed run stopped before the start ({e}). Fix: see its error.") from e
    for i, what in enumerate(("model", "training data (its rows, in order)")):
        if any(e[i] != mine[i] for e in every):
            raise ConfigError(
                f"the ranks of this distributed run hold a different {what}. Fix: build the same model and load "
                "the same whole dataset in the same order on every rank (dptune shards each Poisson batch itself)."
            )
    for _, v in tensors:  # buffers not in the state_dict too (persistent=False: found in review)
        with torch.no_grad():
            v.copy_(_collective(dist.broadcast, v.detach(), "start (parameters from rank 0)"))


def _all_sum(value: torch.Tensor | Tensors) -> torch.Tensor | Tensors:
    """The sum over ranks of one query's value: one all-reduce of the flattened (float64 where it
    is an ``Accumulated``) tensors."""
    if not isinstance(value, dict):
        return _collective(dist.all_reduce, value, "all-reduce of the clipped sums")
    wide = getattr(value, "wide", value)
    flat = torch.cat([v.reshape(-1).to(torch.float64) for v in wide.values()])
    flat = _collective(dist.all_reduce, flat, "all-reduce of the clipped sums")
    parts = flat.split([v.numel() for v in wide.values()])
    out = {k: f.view_as(v).to(v.dtype) for (k, v), f in zip(wide.items(), parts, strict=True)}
    return Accumulated(out, {k: v.dtype for k, v in value.items()}) if value is not wide else out


class ReducingRelease(NoisyRelease):
    """The gateway of one rank: each query's sum over all ranks' shards, then the ordinary release
    (record first, then the noise, which ``BroadcastNoise`` draws once on rank 0)."""

    def release(self, *queries: SumQuery, label: str) -> list[torch.Tensor | Tensors | DeferredSum]:
        return super().release(*(replace(q, value=_all_sum(q.value)) for q in queries), label=label)


class BroadcastNoise(NoiseSource):
    """Rank 0's noise (its seeded or secure stream), broadcast: drawn once per release, the same on
    every rank. The other ranks' streams never advance."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        z = super().normal(like, std) if dist.get_rank() == 0 else torch.empty_like(like)
        return _collective(dist.broadcast, z, "broadcast of the noise")


class ShardedSampler(PoissonSampler):
    """Rank 0's Poisson batch of the whole dataset, broadcast; this rank's share: indices ``rank::N``."""

    def sample(self) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank:
            self.reseed_forward()
        idx = super().sample() if rank == 0 else torch.empty(0, dtype=torch.int64)
        size = _collective(dist.broadcast, torch.tensor([idx.numel()]), "broadcast of the batch")
        if rank:
            idx = torch.empty(int(size), dtype=torch.int64)
        return _collective(dist.broadcast, idx, "broadcast of the batch")[rank::world]


def parts(plan: RunPlan, secure: bool) -> tuple[type[NoiseSource], type[NoisyRelease], type[PoissonSampler]]:
    """``open_run``'s classes of one rank of a distributed run (private strategies only), once every
    rank has the same plan (n, q, T, ν, strategy) and randomness: the same command on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("a distributed run needs the process group first. Fix: dptune.distributed.join().")
    mine = repr((plan.n, plan.sampling_rate, plan.steps, plan.noise_multiplier, plan.strategy.config(), secure))
    every: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(every, mine)
    except RuntimeError as e:  # a rank that stopped before the start (its own error says why)
        raise RankLost(f"a process of the distributed run stopped before the start ({e}). Fix: see its error.") from e
    if any(e != mine for e in every):
        raise ConfigError(
            f"the ranks of this distributed run planned different runs ({sorted(set(every))}). Fix: start "
            "every rank with the same command, data, strategy and options (torchrun does)."
        )
    if not plan.strategy.private:
        raise ConfigError(
            "the non-private baseline ('nodp', NonPrivate) has no gateway to all-reduce through, so it "
            "does not run distributed. Fix: run it on one process, or use a private strategy."
        )
    return BroadcastNoise, ReducingRelease, ShardedSampler


def refuse_in_study(what: str = "a study", how: str = "`dptune tune`") -> None:
    """A study (or train_many) under torchrun would run N copies of every trial: refused."""
    if launched():
        raise ConfigError(
            f"{what} does not run under torchrun: each process would run every trial and spend its "
            "budget again, and its runs are not distributed one by one. Fix: run "
            f"{how} without torchrun (trials in parallel: --executor process or ray, --gpus-per-run), then "
            "train the chosen configuration on several GPUs with `torchrun ... dptune train`."
        )
