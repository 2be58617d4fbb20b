"""How a sweep runs (:class:`SweepOptions`) and the checks made before anything starts.

Every check here refuses what could never work (a trial no machine can place, worker
writes into SQLite) before the database, the corpus or Ray is touched; what depends on a
running Ray (the default GPUs per trial) is resolved after connecting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from qkgeom.plan.spec import SweepError
from qkgeom.store.lifecycle import HEARTBEAT_S
from qkgeom.sweeps.files import default_storage
from qkgeom.sweeps.ray_session import cluster_gpus, local_gpus


@dataclass
class SweepOptions:
    """How to run a sweep (resources, where, resume); see ``qkgeom sweep --help``."""

    db_url: str | None = None
    address: str | None = None  # join a running Ray cluster ("auto" on a head node)
    storage: str | None = None  # Tune storage root; shared storage on a multi-node cluster
    resume: bool = False
    cpus_per_trial: float = 1.0
    gpus_per_trial: float | None = None  # None: 0.25 when the cluster has GPUs, else 0
    max_concurrent: int | None = None
    max_failures: int = 2
    direct_writes: bool = False
    # superseded resume checkpoints older than this are pruned (tests shorten it)
    prune_age_s: float = 60.0
    progress_every_s: float = 10.0
    # seconds between heartbeats of the running trials (qkgeom.store.lifecycle; tests shorten it)
    heartbeat_s: float = HEARTBEAT_S
    num_cpus: int | None = None  # local Ray only (default: all cores)
    ray_temp_dir: str | None = None  # local Ray only (default: a fresh dir under /tmp)
    quiet: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    loggers: tuple[str, ...] = ()  # opt-in trackers (qkgeom.sweeps.trackers): tensorboard, ...


def absolute_sqlite_url(url: str) -> str:
    """SQLite paths made absolute so that trials and later shells find the same file."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:" and not path.startswith("/"):
            return "sqlite:///" + str(Path(path).resolve())
    return url


def check_direct_writes(opts: SweepOptions, db_url: str) -> None:
    """Worker writes need a database that takes many concurrent writers."""
    if opts.direct_writes and not db_url.startswith("postgresql"):
        raise SweepError("--direct-writes needs a PostgreSQL database: SQLite cannot take "
                         "concurrent writers from many Ray workers; drop --direct-writes to "
                         "let the driver write (the default)")


def storage_root(opts: SweepOptions) -> str:
    """``--storage`` (or the default) as an absolute path; a ``--storage`` URL
    (``s3://...``) as it is."""
    if opts.storage is not None and "://" in opts.storage:
        return opts.storage
    return str(Path(opts.storage or default_storage()).expanduser().resolve())


def check_resources(opts: SweepOptions) -> None:
    """Refuse a sweep whose trials can never be placed (they would wait forever).

    Local Ray: against this machine's CPUs (``num_cpus``) and GPUs. A running cluster
    (``--address``) may grow through its autoscaler, so it is only warned about, after
    connecting (:func:`qkgeom.sweeps.ray_session.warn_unplaceable`); ``--cluster`` checks
    the cluster file's node types (:func:`qkgeom.sweeps.cluster.check_cluster_resources`).
    """
    if opts.max_concurrent is not None and opts.max_concurrent < 1:
        raise SweepError("--max-concurrent must be at least 1 (leave it out for no limit)")
    if opts.address is not None:
        return
    cpus = opts.num_cpus or os.cpu_count() or 1
    if opts.cpus_per_trial > cpus:
        raise SweepError(f"--cpus-per-trial {opts.cpus_per_trial:g} is more than this "
                         f"machine's {cpus} CPUs: no trial could ever start; use at most {cpus}")
    gpus = opts.gpus_per_trial or 0.0
    if gpus > 0:
        have = local_gpus()
        if gpus > have:
            raise SweepError(f"--gpus-per-trial {gpus:g} is more than this machine's {have} "
                             f"GPU(s): no trial could ever start; use at most {have}"
                             + (" (or drop it: CPU trials)" if have == 0 else ""))


def gpus_per_trial(opts: SweepOptions) -> float:
    """``--gpus-per-trial``, or (once Ray runs) 0.25 when its cluster has GPUs, else 0."""
    if opts.gpus_per_trial is not None:
        return float(opts.gpus_per_trial)
    return 0.25 if cluster_gpus() > 0 else 0.0
