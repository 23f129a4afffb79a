"""Seeds batched into one computation: S seeds of one configuration on the vectorized engine,
with (seed, client) as the batch of the local steps.

Each seed keeps everything that is a function of its seed: its own federation (partition),
initial model, :class:`fedhier.round.loop.HierarchicalSGD` (grouping, plan, sampling, aggregation,
cloud step, records, checkpoints) and its own run folder, run by the unchanged one-seed code
(:func:`fedhier.engines.vectorized.engine.run_vectorized`). Only the executor differs:
:class:`SeedExecutor` prepares an edge round exactly as :class:`BatchedExecutor` does (start
models, mini-batch rows from its seed, learning rates, faults, stragglers) and hands the local
training to a :class:`SeedLockstep`, which runs the seeds one at a time (threads taking turns,
never two at once) until every one of them waits for local training, then trains the union
of their clients in one :meth:`BatchedExecutor.local_training` call over a flat client axis
``[seed 0's n clients, seed 1's, ...]``, and hands each seed its slice back.

Why a seed's numbers do not change (bit for bit, tests/test_batched_seeds.py): local training
does no reduction across clients (every client's steps, loss and momentum are its own rows of
the batch), and chunks of >= 2 clients give the results of one chunk (docs/engines.md).
Two things do depend on the whole batch, so jobs are batched only with jobs that agree on
them: the padded mini-batch width (a kernel's inner length) and the segments the I steps are
cut into where some client stops early (they set the order of the float64 loss sum), and the
learning rates. Everything else (aggregation per edge, evaluation, records) stays per seed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhier.common.errors import ConfigError, Refusal
from fedhier.data.federation import Federation
from fedhier.engines.vectorized.engine import BatchedExecutor, run_vectorized
from fedhier.engines.vectorized.kernels import ClientRows
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig

Params = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------ the jobs
@dataclass
class LocalJob:
    """One seed's edge round of local training, as :meth:`BatchedExecutor.train` asks for it.

    Attributes:
        executor: the seed's executor (its rows, kept momentum buffers).
        params: name -> [n, *shape], the start models, trained in place.
        rows: int [I, n, width], pool rows of the seed's mini-batches (its own pool).
        rates, trains, steps: as :meth:`BatchedExecutor.local_training` takes them.
        grad: the torch grad mode of the asking thread (the batch runs in it).
    """

    executor: SeedExecutor
    params: Params
    rows: torch.Tensor
    rates: tuple[float, ...]
    trains: np.ndarray
    steps: np.ndarray
    grad: bool

    def key(self) -> tuple[Any, ...]:
        """Jobs batch together only when these agree (see the module docstring)."""
        alone = id(self.executor) if self.executor.data.num_clients < 2 else 0  # a batch of
        # one client runs another kernel than a batch of more (docs/engines.md, --client-chunk)
        return (self.executor.data.width, tuple(np.unique(self.steps).tolist()), self.rates,
                bool(self.executor.momentum), self.grad, alone, self.executor.signature())


def training_signature(executor: BatchedExecutor) -> tuple[Any, ...]:
    """What the joint executor takes from the first job's executor and every job must share
    (runs of different configurations batched together, :func:`run_batched`): the model's
    class and parameter shapes (so its local training), the optimizer, whether its state is
    kept, the chunk setting and the device."""
    shapes = tuple((k, tuple(v.shape), str(v.dtype))
                   for k, v in executor.model.state_dict().items())
    return (type(executor.model).__qualname__, shapes, executor.optimizer,
            executor.cfg.optimizer_state, executor.cfg.client_chunk, str(executor.device))


def train_jobs(jobs: Sequence[LocalJob]) -> tuple[list[torch.Tensor], list[int]]:
    """Run ``jobs`` (seeds' edge rounds); returns each one's float64 [n] summed losses, and
    the number of jobs in each batched computation.

    Jobs with the same :meth:`LocalJob.key` are trained as one batched computation on a
    flat client axis; a job alone is trained by its own executor (the one-seed path).
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(job.key(), []).append(i)
    losses: list[torch.Tensor] = [torch.empty(0)] * len(jobs)
    for members in groups.values():
        group = [jobs[i] for i in members]
        with torch.set_grad_enabled(group[0].grad):
            if len(group) == 1:
                job = group[0]
                out = [BatchedExecutor.local_training(job.executor, job.params, job.rows,
                                                      job.rates, job.trains, job.steps)]
            else:
                out = train_together(group)
        for i, loss in zip(members, out, strict=True):
            losses[i] = loss
    return losses, [len(m) for m in groups.values()]


def train_together(jobs: Sequence[LocalJob]) -> list[torch.Tensor]:
    """Jobs of one key as one :meth:`BatchedExecutor.local_training` over their clients
    laid end to end; each job's params and its executor's kept momentum are set to its slice.

    After the first edge round each seed's start-model buffers and momentum are views into
    the joint tensors (slices of the flat client axis), so later edge rounds copy nothing;
    a seed whose tensors are not those views (first round, a resumed seed) is concatenated.
    """
    executors = [job.executor for job in jobs]
    joint = joint_executor(executors)
    offsets = np.cumsum([0] + [ex.data.num_clients for ex in executors])
    slices = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
    params = joined(joint.buffers, [job.params for job in jobs], slices)
    in_place = params is joint.buffers  # the seeds' buffers are its slices: results land there
    joint.buffers = params
    joint.momentum = joined(joint.momentum, [ex.momentum for ex in executors], slices)
    pool = pool_offsets(executors)
    rows = torch.cat([job.rows + int(base) for job, base in zip(jobs, pool, strict=True)],
                     dim=1)
    losses = joint.local_training(params, rows, jobs[0].rates,
                                  np.concatenate([job.trains for job in jobs]),
                                  np.concatenate([job.steps for job in jobs]))
    for job, (lo, hi) in zip(jobs, slices, strict=True):
        if not in_place:
            for key, value in job.params.items():
                value.copy_(params[key][lo:hi])
            job.executor.buffers = {k: v[lo:hi] for k, v in params.items()}  # next: in place
        job.executor.momentum = {k: v[lo:hi] for k, v in joint.momentum.items()}
    return [losses[lo:hi] for lo, hi in slices]


def views_of(joint: Params, own: Params, key: str, lo: int, hi: int) -> torch.Tensor | None:
    """``own[key]`` when it is a view of rows lo..hi-1 of ``joint[key]`` (else None)."""
    value, whole = own.get(key), joint.get(key)
    if value is None or whole is None or value._base is not whole or hi - lo != len(value):
        return None
    return value if value.data_ptr() == whole[lo:hi].data_ptr() else None


def joined(joint: Params, parts: Sequence[Params], slices: list[tuple[int, int]]) -> Params:
    """name -> [N, *shape]: ``joint`` itself when every part is its slice (nothing copied),
    else the parts concatenated ({} when the parts are empty)."""
    if not parts[0]:
        return {}
    if joint and all(views_of(joint, part, k, lo, hi) is part[k]
                     for part, (lo, hi) in zip(parts, slices, strict=True) for k in part):
        return joint
    return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}


def pool_offsets(executors: Sequence[BatchedExecutor]) -> list[int]:
    """Where each executor's pool of rows starts in the joint pool (0 when shared)."""
    out: list[int] = []
    at, seen = 0, dict[int, int]()
    for ex in executors:
        if id(ex.data.x) in seen:
            out.append(seen[id(ex.data.x)])
            continue
        seen[id(ex.data.x)] = at
        out.append(at)
        at += len(ex.data.y)
    return out


def joint_executor(executors: Sequence[SeedExecutor]) -> BatchedExecutor:
    """A :class:`BatchedExecutor` over the clients of ``executors`` end to end (its pool the
    distinct pools of rows one after another), kept for the lockstep's life."""
    lockstep = executors[0].lockstep
    assert lockstep is not None
    key = tuple(id(ex) for ex in executors)
    if key in lockstep.joints:
        return lockstep.joints[key]
    first, starts = executors[0], pool_offsets(executors)
    pools = {id(ex.data.x): ex.data for ex in executors}
    data = ClientRows(
        x=torch.cat([d.x for d in pools.values()]) if len(pools) > 1 else first.data.x,
        y=torch.cat([d.y for d in pools.values()]) if len(pools) > 1 else first.data.y,
        rows=[r + base for ex, base in zip(executors, starts, strict=True) for r in ex.data.rows],
        batch=np.concatenate([ex.data.batch for ex in executors]), width=first.data.width,
        weight=torch.cat([ex.data.weight for ex in executors]))
    joint = BatchedExecutor(cfg=first.cfg, model=first.model, fed=first.fed, data=data,
                            train_fn=first.train_fn, device=first.device,
                            optimizer=first.optimizer, faults=first.faults)
    lockstep.joints[key] = joint
    return joint


# ------------------------------------------------------------------------------ the executor
@dataclass
class SeedExecutor(BatchedExecutor):
    """A seed's :class:`BatchedExecutor` whose local training waits for the other seeds'
    and runs with theirs (:class:`SeedLockstep`); everything else is the one-seed executor."""

    lockstep: SeedLockstep | None = None
    _signature: tuple[Any, ...] | None = None

    def signature(self) -> tuple[Any, ...]:
        """:func:`training_signature` of this executor (computed once)."""
        if self._signature is None:
            self._signature = training_signature(self)
        return self._signature

    def local_training(self, params: Params, rows: torch.Tensor, rates: Sequence[float],
                       trains: np.ndarray, steps: np.ndarray,
                       start_step: int | None = None) -> torch.Tensor:
        assert self.lockstep is not None and not self.cfg.langevin().active  # check_seeds
        return self.lockstep.submit(LocalJob(
            executor=self, params=params, rows=rows, rates=tuple(float(r) for r in rates),
            trains=trains, steps=steps, grad=torch.is_grad_enabled()))


# ------------------------------------------------------------------------------ the lockstep
class _Interrupted(BaseException):
    """Raised in a seed's thread when the batch was interrupted (Ctrl-C in the main thread)."""


class SeedLockstep:
    """Runs one function per seed in threads that take turns (one runs at a time, in seed
    order), and trains their pending local-training jobs together (:func:`train_jobs`) each
    time every unfinished seed waits for one."""

    def __init__(self) -> None:
        self.joints: dict[tuple[int, ...], BatchedExecutor] = {}  # by the seeds' executors
        self.pools: list[ClientRows] = []  # distinct pools of rows (:func:`share_pool`)
        self.batch_sizes: list[int] = []  # jobs per batched computation, in order
        self._back = threading.Semaphore(0)
        self._local = threading.local()
        self._tasks: list[_Task] = []
        self._running: _Task | None = None  # the seed whose turn it is

    def submit(self, job: LocalJob) -> torch.Tensor:
        """Called from a seed's thread: wait until the batch has trained ``job``."""
        task: _Task = self._local.task
        task.job = job
        self._back.release()
        task.go.acquire()
        if task.interrupt:
            raise KeyboardInterrupt
        assert task.result is not None
        result, task.result = task.result, None
        return result

    def run(self, functions: Sequence[Callable[[], Any]]) -> list[tuple[Any, BaseException | None]]:
        """Run ``functions`` (one per seed) to the end; returns (value, error) of each.
        A Ctrl-C interrupts every seed (each sees KeyboardInterrupt in its local training,
        so its run checkpoints as a one-seed run does) and is raised again here."""
        self._tasks = [_Task(self, fn) for fn in functions]
        for task in self._tasks:
            task.thread.start()
        interrupted = False
        try:
            while True:
                for task in self._tasks:  # each until it waits for training or ends
                    if not task.done:
                        self._turn(task)
                waiting = [t for t in self._tasks if not t.done and t.job is not None]
                if not waiting:
                    break
                losses, sizes = train_jobs([t.job for t in waiting if t.job is not None])
                self.batch_sizes.extend(sizes)
                for task, loss in zip(waiting, losses, strict=True):
                    task.job, task.result = None, loss
        except KeyboardInterrupt:
            interrupted = True
            if self._running is not None:  # let the seed on its turn reach its next wait
                self._back.acquire()
                self._running = None
            for task in self._tasks:
                if not task.done:
                    task.interrupt = True
                    self._turn(task)
        for task in self._tasks:
            task.thread.join()
        if interrupted:
            raise KeyboardInterrupt
        return [(t.value, t.error) for t in self._tasks]

    def _turn(self, task: _Task) -> None:
        """Let ``task`` run until it waits for training or ends (one release, one wait)."""
        self._running = task
        task.go.release()
        self._back.acquire()
        self._running = None


class _Task:
    """A seed's thread: it runs only between ``go`` and the lockstep's ``_back``."""

    def __init__(self, lockstep: SeedLockstep, function: Callable[[], Any]) -> None:
        self.lockstep, self.function = lockstep, function
        self.go = threading.Semaphore(0)
        self.job: LocalJob | None = None
        self.result: torch.Tensor | None = None
        self.interrupt = False
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        self.go.acquire()
        self.lockstep._local.task = self
        try:
            self.value = self.function()
        except BaseException as exc:  # handed to the caller of SeedLockstep.run
            self.error = exc
        finally:
            self.done = True
            self.lockstep._back.release()


# ------------------------------------------------------------------------------ runs
#: What ``fedhier run --seeds`` refuses (docs/hsgd.md's table).
REFUSALS = (
    Refusal("`fedhier run --seeds` with `--langevin-temperature`",
            "not yet: the seeds' joint computation would key every seed's noise by the first "
            "seed; run the seeds one by one",
            ("--engine", "vectorized", "--seeds", "0,1", "--langevin-temperature", "0.01"),
            "--seeds does not batch --langevin-temperature"),
)

def check_seeds(cfg: RunConfig, seeds: Sequence[int]) -> None:
    """One-line ConfigError for what ``fedhier run --seeds`` cannot batch."""
    if cfg.engine != "vectorized":
        raise ConfigError(f"--seeds batches seeds on the vectorized engine; engine "
                          f"'{cfg.engine}' runs one seed per run (fedhier run --seed S, or "
                          "fedhier sweep)")
    if getattr(cfg, "edge_servers", False):
        raise ConfigError("--seeds: edge_servers is for fedhier deploy local; leave it off")
    if cfg.langevin_temperature > 0:
        raise ConfigError("--seeds does not batch --langevin-temperature (its noise is keyed "
                          "by each seed); run the seeds one by one (fedhier run --seed S, or "
                          "fedhier sweep)")


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` (or ``0-4``, both ends included) as a list of distinct seeds."""
    seeds: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            lo, sep, hi = part.partition("-") if not part.startswith("-") else (part, "", "")
            seeds.extend(range(int(lo), int(hi) + 1) if sep else [int(part)])
    except ValueError:
        raise ConfigError(f"--seeds {text}: give seeds as 0,1,2 or 0-4") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text}: give distinct seeds >= 0, as 0,1,2 or 0-4")
    return seeds


def seed_folder(out: str | Path, seed: int) -> Path:
    """The run folder of ``seed`` in a batched run's folder ``out``: OUT/seed<seed> (the
    layout of a sweep's arm, docs/sweeps.md)."""
    return Path(out) / f"seed{seed}"


def run_seeds(cfgs: Sequence[RunConfig], folders: Sequence[RunFolder], progress: bool = True,
              *, wrap: Callable[[int, Callable[[], dict[str, Any]]], Any] | None = None,
              federations: Sequence[Federation] | None = None,
              lockstep: SeedLockstep | None = None) -> list[tuple[Any, BaseException | None]]:
    """Run ``cfgs`` (one configuration, one seed each) as one batched computation, each into
    its folder as ``run_vectorized`` would; returns each seed's (summary, error).

    Args:
        progress: show seed 0's progress bar (the seeds advance together).
        wrap: ``wrap(i, run)`` runs seed i's ``run`` (e.g. inside its trackers); default: run.
        federations: the seeds' data instead of ``prepare(cfg)`` (benchmarks).
        lockstep: the lockstep to run on (its ``batch_sizes`` tell how jobs were batched).
    """
    if len({c.replace(seed=0, out="") for c in cfgs}) > 1:
        raise ConfigError("seeds batched together must share every setting but seed and out")
    return run_batched(cfgs, folders, progress, wrap=wrap, federations=federations,
                       lockstep=lockstep)


def run_batched(cfgs: Sequence[RunConfig], folders: Sequence[RunFolder], progress: bool = True,
                *, wrap: Callable[[int, Callable[[], dict[str, Any]]], Any] | None = None,
                federations: Sequence[Federation] | None = None,
                lockstep: SeedLockstep | None = None) -> list[tuple[Any, BaseException | None]]:
    """Run vectorized configurations that may differ in anything (a sweep's trials: alpha,
    grouping, periods, seeds, ...) as :func:`run_seeds` runs seeds: each its own run, its
    edge rounds' local training batched with every other run's that waits at the same time
    and agrees on :meth:`LocalJob.key` (the same model, optimizer, learning rates, batch
    width, ...), the others trained alone. Each run's numbers are its one-run numbers, bit for
    bit (tests/test_sweep_batched.py). Arguments as :func:`run_seeds`."""
    lockstep = lockstep if lockstep is not None else SeedLockstep()

    def executor_for(cfg: RunConfig, fed: Federation, model: Any, device: Any) -> SeedExecutor:
        base = BatchedExecutor.build(cfg, fed, model, device)
        ex = SeedExecutor(**{f: getattr(base, f) for f in ("cfg", "model", "fed", "data",
                                                           "train_fn", "device", "optimizer",
                                                           "faults", "forward")},
                          lockstep=lockstep)
        share_pool(ex, lockstep)
        return ex

    def one(i: int) -> Callable[[], Any]:
        def run() -> dict[str, Any]:
            return run_vectorized(cfgs[i], folders[i], progress and i == 0,
                                  federation=federations[i] if federations else None,
                                  make_executor=executor_for)
        return (lambda: wrap(i, run)) if wrap is not None else run

    return lockstep.run([one(i) for i in range(len(cfgs))])


def share_pool(executor: BatchedExecutor, lockstep: SeedLockstep) -> None:
    """Let seeds whose pools of rows are equal (a dataset with a fixed training split: only
    the partition depends on the seed) share one copy, so the joint pool is not S copies.
    Pools that differ (digits' split is seeded) are laid end to end in the joint pool, which
    then holds a second copy of them."""
    data = executor.data
    for other in lockstep.pools:
        if (other.x.shape == data.x.shape and other.x.dtype == data.x.dtype
                and torch.equal(other.y, data.y) and torch.equal(other.x, data.x)):
            data.x, data.y = other.x, other.y
            return
    lockstep.pools.append(data)
