"""Cluster files and launching: ``qkgeom sweep --cluster FILE``.

A Ray cluster launcher file is checked offline (:func:`validate_cluster_file`), qkgeom is
shipped to its nodes as a wheel (:mod:`qkgeom.sweeps.ship`), the cluster is started or updated
with Ray's cluster launcher and the sweep's driver runs on the head node, detached
(:func:`launch_on_cluster`). The sweep itself is :mod:`qkgeom.sweeps.driver`'s; nothing here runs
trials. Ray is imported inside the functions (``ray.autoscaler`` only).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QkgeomError

if TYPE_CHECKING:
    from qkgeom.plan.spec import SweepPlan
    from qkgeom.sweeps.ship import Shipped


class ClusterConfigError(QkgeomError):
    """An invalid cluster file; the message names the key."""


# where each cloud's node_config names the machine (Ray leaves node_config free-form)
INSTANCE_KEYS = {"aws": ("InstanceType",), "gcp": ("machineType",),
                 "azure": ("azure_arm_parameters", "vmSize")}


# ---------------------------------------------------------------------- validation
def validate_cluster_file(path: str | Path) -> dict[str, Any]:
    """Validate a Ray cluster launcher file offline; return it (as read) or raise.

    Three layers: Ray's JSON schema (types, unknown keys), our own checks (head_node_type,
    instance types, qkgeom installed, GPU workers, a head without trials), then Ray's own
    ``prepare_config`` + ``validate_config`` (node types, worker counts).
    """
    cfg, where = _read_cluster_file(Path(path))
    _check_ray_schema(cfg, where)
    ptype = _check_provider(cfg, where)
    _check_node_types(cfg, where, ptype)
    _check_qkgeom_installed(cfg, where)
    _check_with_ray_launcher(cfg, where)
    return cfg


def _read_cluster_file(p: Path) -> tuple[dict[str, Any], str]:
    import yaml

    if not p.is_file():
        raise ClusterConfigError(f"cluster file {str(p)!r} not found")
    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        from qkgeom.plan.spec import parse_error

        raise ClusterConfigError(f"{p}: cannot parse YAML: {parse_error(e)}") from None
    if not isinstance(cfg, dict):
        raise ClusterConfigError(f"{p}: expected a mapping at the top level")
    return cfg, str(p)


def _schema_path(err: Any) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "(top level)"


def _check_ray_schema(cfg: dict[str, Any], where: str) -> None:
    """Ray's JSON schema of cluster files: types and unknown keys; the first error, named."""
    import jsonschema
    import ray

    schema_file = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_file.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(cfg),
                    key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        raise ClusterConfigError(f"{where}: {_schema_path(e)}: {e.message}")


def _check_provider(cfg: dict[str, Any], where: str) -> str:
    """The cloud (``provider.type``), one Ray knows; a near miss is named."""
    provider = cfg.get("provider") or {}
    ptype = provider.get("type")
    if not ptype:
        raise ClusterConfigError(f"{where}: provider.type: missing (aws, gcp, local, ...)")
    from ray.autoscaler._private.providers import _NODE_PROVIDERS

    known = sorted(set(_NODE_PROVIDERS) - {"fake_multinode_docker"})
    if ptype not in _NODE_PROVIDERS:
        import difflib

        near = difflib.get_close_matches(str(ptype), known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ClusterConfigError(f"{where}: provider.type: unknown cloud {ptype!r}; {hint}"
                                 f"use one of {', '.join(known)}")
    return ptype


def _check_node_types(cfg: dict[str, Any], where: str, ptype: str) -> None:
    """A head node type that runs no trials, and GPU workers with their instance types."""
    types = cfg.get("available_node_types")
    if ptype != "local" and not types:
        raise ClusterConfigError(f"{where}: available_node_types: missing; declare a head "
                                 "node type and GPU worker node types")
    if not types:
        return
    head = cfg.get("head_node_type")
    if not head:
        raise ClusterConfigError(f"{where}: head_node_type: missing; name one of "
                                 f"available_node_types ({', '.join(types)})")
    if head not in types:
        raise ClusterConfigError(f"{where}: head_node_type: {head!r} is not in "
                                 f"available_node_types ({', '.join(types)})")
    _check_instance_types(types, where, ptype)
    workers = {n: t for n, t in types.items() if n != head and t.get("max_workers", 1)}
    for name, nt in workers.items():
        if float((nt.get("resources") or {}).get("GPU", 0)) <= 0:
            raise ClusterConfigError(
                f"{where}: available_node_types.{name}.resources.GPU: missing; declare "
                "the worker's GPUs (e.g. resources: {CPU: 4, GPU: 1}) so that the "
                "autoscaler can place GPU trials")
    head_res = types[head].get("resources") or {}
    if workers and head_res.get("CPU", 1) != 0:
        raise ClusterConfigError(
            f"{where}: available_node_types.{head}.resources: the head must run no "
            "trials: set resources: {CPU: 0, GPU: 0} (the driver and database live there)")


def _check_instance_types(types: dict[str, Any], where: str, ptype: str) -> None:
    keys = INSTANCE_KEYS.get(ptype)
    if not keys:
        return
    for name, nt in types.items():
        node = nt.get("node_config") or {}
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        if not node:
            raise ClusterConfigError(
                f"{where}: available_node_types.{name}.node_config."
                f"{'.'.join(keys)}: missing (the {ptype} instance type)")


def _check_qkgeom_installed(cfg: dict[str, Any], where: str) -> None:
    from qkgeom.sweeps.ship import ShipError, check_installs

    try:
        check_installs(cfg, where)
    except ShipError as e:
        raise ClusterConfigError(str(e)) from None


def _check_with_ray_launcher(cfg: dict[str, Any], where: str) -> None:
    """Ray's own ``prepare_config`` + ``validate_config`` (node types, worker counts)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        prepared = prepare_config(json.loads(json.dumps(cfg)))
        validate_config(prepared)
    except Exception as e:  # Ray raises ValueError/jsonschema errors with its own text
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterConfigError(f"{where}: rejected by Ray's cluster launcher: {msg}") \
            from None


def check_cluster_resources(cfg: dict[str, Any], where: str, cpus: float,
                            gpus: float | None) -> None:
    """Refuse per-trial resources that no node type of a cluster file declares."""
    types = cfg.get("available_node_types") or {}
    head = cfg.get("head_node_type")
    declared = [t.get("resources") for n, t in types.items()
                if n != head or len(types) == 1]
    if not declared or any(r is None or "CPU" not in r for r in declared):
        return  # some node type's size is detected at launch: cannot know in advance
    fits = [r for r in declared if float(r.get("CPU", 0)) >= cpus
            and float(r.get("GPU", 0)) >= (gpus or 0)]
    if not fits:
        most_c = max(float(r.get("CPU", 0)) for r in declared)
        most_g = max(float(r.get("GPU", 0)) for r in declared)
        raise ClusterConfigError(
            f"{where}: no node type has {cpus:g} CPU and {gpus or 0:g} GPU for "
            f"one trial (the largest: {most_c:g} CPU, {most_g:g} GPU); lower "
            "--cpus-per-trial/--gpus-per-trial or declare a larger node type")


def check_ssh_keys(cfg: dict[str, Any], where: str) -> None:
    """Refuse SSH key files the cluster file names but this machine lacks (checked at
    launch, not by :func:`validate_cluster_file`: a file valid here may name keys that
    exist only on the machine that launches it)."""
    auth = cfg.get("auth") or {}
    for key in ("ssh_private_key", "ssh_public_key"):
        if auth.get(key) and not Path(str(auth[key])).expanduser().is_file():
            raise ClusterConfigError(
                f"{where}: auth.{key}: {auth[key]} does not exist; create the key pair "
                f"(ssh-keygen -t ed25519 -f {auth[key]}) or fix the path")


# ---------------------------------------------------------------------- the remote driver
def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)


def remote_sweep_command(name: str, *, spec_remote: str | None, preset: str | None,
                         data: str | None, sets: tuple[str, ...] | list[str],
                         db: str | None, resume: bool, gpus_per_trial: float | None,
                         cpus_per_trial: float, max_concurrent: int | None,
                         max_failures: int, direct_writes: bool, storage: str | None,
                         logdir: str = "~/qkgeom-sweeps", address: str = "auto",
                         snapshots: str | None = None) -> str:
    """The shell line that starts the sweep driver on the head, detached from SSH."""
    args = ["sweep", "--address", address, "--name", name]
    if spec_remote:
        args += ["--spec", spec_remote]
    elif preset:
        args += ["--preset", preset]
    for k, v in (("--data", data), ("--db", db), ("--storage", storage),
                 ("--snapshots", snapshots)):
        if v:
            args += [k, v]
    for s in sets:
        args += ["--set", s]
    if resume:
        args.append("--resume")
    if direct_writes:
        args.append("--direct-writes")
    if gpus_per_trial is not None:
        args += ["--gpus-per-trial", f"{gpus_per_trial:g}"]
    if max_concurrent:
        args += ["--max-concurrent", str(max_concurrent)]
    args += ["--cpus-per-trial", f"{cpus_per_trial:g}", "--max-failures", str(max_failures),
             "--progress-every", "30"]
    line = " ".join(_q(a) for a in args)
    log = f"{logdir}/{name}.log"
    # the cluster files install qkgeom into ~/qkgeom-venv; other nodes find it on PATH
    return (f'export PATH="$HOME/qkgeom-venv/bin:$PATH"; mkdir -p {logdir} && '
            f"cd {logdir} && (setsid nohup qkgeom {line} > {log} 2>&1 < /dev/null &) && "
            f"echo started: {log}")


def head_address(cfg: dict[str, Any]) -> str:
    """The address the driver on the head uses: the head's own GCS via localhost.

    ``auto`` can pick the wrong interface (or another Ray instance on a shared machine);
    the port comes from ``ray start --head --port=N`` in head_start_ray_commands.
    """
    import re

    for c in cfg.get("head_start_ray_commands") or []:
        m = re.search(r"ray start[^;&|]*--head[^;&|]*?--port[= ](\d+)", str(c))
        if m:
            return f"127.0.0.1:{m.group(1)}"
    return "127.0.0.1:6379"


# ---------------------------------------------------------------------- launching
def launch_on_cluster(cluster_file: str, *, plan: SweepPlan | None, name: str,
                      spec_file: str | None, preset: str | None, data: str | None,
                      sets: tuple[str, ...] | list[str], db: str | None, resume: bool,
                      gpus_per_trial: float | None, cpus_per_trial: float,
                      max_concurrent: int | None, max_failures: int, direct_writes: bool,
                      storage: str | None, dry_run: bool = False,
                      out: Any = print, snapshots: str | None = None) -> dict[str, Any]:
    """Validate the cluster file, ship qkgeom, start/update the cluster, run the driver.

    The spec is validated here first (``plan``), so a bad spec never starts machines.
    What is launched is a derived copy of the file (:mod:`qkgeom.sweeps.ship`): the running
    qkgeom as a wheel (and a local ``--data``) in ``file_mounts``. ``dry_run`` prints that
    file and the remote command and starts nothing.
    """
    cfg = validate_cluster_file(cluster_file)
    gpus_per_trial = _preflight(cfg, cluster_file, cpus_per_trial, gpus_per_trial, storage,
                                db, out)
    derived, derived_file, remote_data, shipped = _derive_cluster_file(cfg, cluster_file,
                                                                       data, out)
    spec_remote = f"~/qkgeom-sweeps/{name}{Path(spec_file).suffix}" if spec_file else None
    cmd = remote_sweep_command(
        name, spec_remote=spec_remote, preset=preset if not spec_file else None,
        data=remote_data or data, sets=sets, db=db, resume=resume,
        gpus_per_trial=gpus_per_trial, cpus_per_trial=cpus_per_trial,
        max_concurrent=max_concurrent, max_failures=max_failures,
        direct_writes=direct_writes, storage=storage, address=head_address(cfg),
        snapshots=snapshots)
    if dry_run:
        import yaml

        out(f"dry run: nothing started. derived cluster file {derived_file}:\n"
            f"{yaml.safe_dump(derived, sort_keys=False)}\nremote command (on the head):\n{cmd}")
        return {"command": cmd, "cluster_file": derived_file, "shipped": shipped}
    _start_cluster(cluster_file, derived_file, out)
    _start_driver(derived_file, cmd, spec_file, spec_remote)
    follow = follow_commands(cluster_file, name, db)
    _print_follow(cluster_file, name, follow, out, head_db_file(db))
    return {"command": cmd, "follow": follow, "cluster_file": derived_file,
            "shipped": shipped}


def _has_gpu_workers(cfg: dict[str, Any]) -> bool:
    types = cfg.get("available_node_types") or {}
    return any(float((t.get("resources") or {}).get("GPU", 0)) > 0
               for n, t in types.items() if n != cfg.get("head_node_type"))


def _preflight(cfg: dict[str, Any], cluster_file: str, cpus_per_trial: float,
               gpus_per_trial: float | None, storage: str | None, db: str | None,
               out: Any) -> float | None:
    """Checks and notes before anything is built or started; the GPUs per trial to use."""
    has_gpu_workers = _has_gpu_workers(cfg)
    if gpus_per_trial is None and has_gpu_workers:
        gpus_per_trial = 0.25  # the autoscaler sees no GPU before a worker exists
    check_cluster_resources(cfg, cluster_file, cpus_per_trial, gpus_per_trial)
    check_ssh_keys(cfg, cluster_file)
    if has_gpu_workers and not (storage and "://" in storage):
        out("warning: a multi-node cluster needs shared Tune storage; pass --storage "
            "s3://... or gs://... (a head-local path fails once trials run on workers)")
    if db and db.startswith("sqlite") or (db and "://" not in db):
        out(f"note: the SQLite database {db} lives on the head node")
    return gpus_per_trial


def _derive_cluster_file(cfg: dict[str, Any], cluster_file: str, data: str | None,
                         out: Any) -> tuple[dict[str, Any], str, str | None, Shipped | None]:
    """Build the wheel to ship (when the file installs ``$QKGEOM_WHEEL``) and write the
    derived cluster file: ``(derived, its path, the remote --data, the shipped wheel)``."""
    import tempfile

    from qkgeom.sweeps import ship

    local_data = ship.data_to_ship(data)  # a too-large corpus is refused before any build
    tmp = Path(tempfile.mkdtemp(prefix="qkgeom-cluster-"))
    shipped = None
    if ship.ships_wheel(cfg):
        shipped = ship.build_wheel(tmp)
        out(f"shipping qkgeom {shipped.version} ({shipped.wheel})")
    else:
        out(f"note: {cluster_file} installs qkgeom itself (no $QKGEOM_WHEEL): the nodes run "
            "that qkgeom, not this one")
    derived, remote_data = ship.derive_cluster_config(cfg, shipped, local_data)
    derived_file = str(ship.write_cluster_file(derived, tmp, Path(cluster_file).stem))
    return derived, derived_file, remote_data, shipped


def _start_cluster(cluster_file: str, derived_file: str, out: Any) -> None:
    """``ray up`` through Ray's SDK; a credentials failure becomes one line."""
    from ray.autoscaler import sdk

    from qkgeom.sweeps import ship

    out(f"starting/updating the Ray cluster of {cluster_file} (ray up {derived_file}) ...")
    t0 = time.perf_counter()
    try:
        sdk.create_or_update_cluster(derived_file, no_restart=False, restart_only=False,
                                     no_config_cache=True)
    except Exception as e:
        msg = ship.credentials_error(e, cluster_file)
        if msg is None:
            raise
        raise ClusterConfigError(msg) from None
    out(f"cluster up in {time.perf_counter() - t0:.0f} s")


def _start_driver(derived_file: str, cmd: str, spec_file: str | None,
                  spec_remote: str | None) -> None:
    """Copy the spec file to the head (if any) and start the detached driver there."""
    from ray.autoscaler import sdk

    if spec_file:
        sdk.run_on_cluster(derived_file, cmd="mkdir -p ~/qkgeom-sweeps")
        sdk.rsync(derived_file, source=str(Path(spec_file).resolve()),
                  target=spec_remote, down=False)
    sdk.run_on_cluster(derived_file, cmd=cmd)


def follow_commands(cluster_file: str, name: str, db: str | None) -> dict[str, str]:
    """The commands that follow a launched sweep: its log, status, a shell, a resume."""
    db_arg = f" --db {_q(db)}" if db else ""
    venv = 'export PATH="$HOME/qkgeom-venv/bin:$PATH"; '
    return {
        "log": f"ray exec {cluster_file} 'tail -f ~/qkgeom-sweeps/{name}.log'",
        "status": f"ray exec {cluster_file} '{venv}cd ~/qkgeom-sweeps && "
                  f"qkgeom status --name {name}{db_arg}'",
        "attach": f"ray attach {cluster_file}",
        "resume": f"qkgeom sweep --cluster {cluster_file} --resume --name {name}{db_arg}",
    }


def head_db_file(db: str | None) -> str | None:
    """The SQLite file the driver on the head writes (it runs in ~/qkgeom-sweeps), or
    None for PostgreSQL. No ``--db``: the default file there (the head's environment
    sets no $QKGEOM_DB)."""
    from qkgeom.store.engine import resolve_url, sqlite_path

    if not db:
        return "~/qkgeom-sweeps/qkgeom.db"
    url = resolve_url(db)
    path = sqlite_path(url) if url.startswith("sqlite") else None
    if path is None:
        return None
    return path if path.startswith(("/", "~")) else f"~/qkgeom-sweeps/{path}"


def _print_follow(cluster_file: str, name: str, follow: dict[str, str], out: Any,
                  db_file: str | None = "~/qkgeom-sweeps/qkgeom.db") -> None:
    if db_file is None:
        results = ("results: query the PostgreSQL database from anywhere (qkgeom "
                   "query/stats --db URL)\n")
    else:
        results = ("results: fetch the SQLite file from the head once the sweep has ended "
                   "(while it runs, the newest results are still in its -wal file, which a "
                   f"copy of the file alone lacks):\n  ray rsync-down {cluster_file} {db_file} "
                   f"./{Path(db_file).name}\n")
    out(f"sweep {name} is running on the head node, detached (it outlives this shell).\n"
        f"  follow its log:   {follow['log']}\n"
        f"  trial progress:   {follow['status']}\n"
        f"  a shell there:    {follow['attach']}\n"
        f"  after a failure:  {follow['resume']}\n"
        f"{results}stop the cluster when done: ray down {cluster_file}")
