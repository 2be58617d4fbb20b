"""Ship the running qkgeom (and a local corpus) to a cluster made by Ray's cluster launcher.

``qkgeom sweep --cluster FILE`` never asks a node to fetch qkgeom from somewhere else: it
builds a wheel of the exact code it runs (:func:`build_wheel`), names it by content
(version ``X+h<hash>``), and writes a *derived* copy of the cluster file
(:func:`derive_cluster_config`) that adds the wheel (and a ``--data`` directory) to
``file_mounts`` and sets ``$QKGEOM_WHEEL`` for every setup command that mentions it. Ray
syncs ``file_mounts`` to the head and from the head to every worker, including workers the
autoscaler starts later, and reruns setup commands when their contents change.

The wheel carries ``qkgeom/_shipped.py`` with its version, content hash and the git commit
(and dirty flag) of the checkout it was built from, so the code version and commit a node
records (:func:`code_version`, :mod:`qkgeom.sweeps.provenance`) are the shipped wheel's,
not the node's guess.
No Ray import here: this module is plain files, hashes and YAML.
"""

from __future__ import annotations

import copy
import hashlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkgeom.errors import QkgeomError

WHEEL_VAR = "QKGEOM_WHEEL"  # the setup commands' handle on the shipped wheel
REMOTE_SHIP = "~/qkgeom-ship"  # where the wheel lands on every node
REMOTE_DATA = "~/qkgeom-data"  # where a shipped --data directory lands
# Ray copies file_mounts to every node (and the head to every new worker): above this a
# corpus is better downloaded on each node (--data wikitext-103, ~540 MB raw).
MAX_DATA_BYTES = 256 * 2**20
_SKIP = ("__pycache__", "*.pyc", "*.pyo", "_shipped.py", "*.egg-info", "build")


class ShipError(QkgeomError):
    """qkgeom (or a corpus) cannot be shipped to the cluster; the message says what to do."""


@dataclass(frozen=True)
class Shipped:
    """A built wheel: its file, its version (``base+h<hash>``) and the content hash."""

    wheel: Path
    version: str
    content_hash: str


# ---------------------------------------------------------------------- what runs here
def source_root() -> Path | None:
    """The checkout the running qkgeom is imported from (has qkgeom's pyproject.toml)."""
    import qkgeom

    root = Path(qkgeom.__file__).resolve().parent.parent
    pp = root / "pyproject.toml"
    if pp.is_file() and re.search(r'^name\s*=\s*"qkgeom"', pp.read_text(), re.M):
        return root
    return None


def _package_files(root: Path) -> list[tuple[str, Path]]:
    """(name inside the wheel, file) of the package sources under ``root``.

    ``root`` is a checkout (``qkgeom/``, top-level ``migrations/`` that installs as
    ``qkgeom.migrations``, ``pyproject.toml``) or a site-packages directory.
    """
    out: list[tuple[str, Path]] = []
    for top, prefix in ((root / "qkgeom", "qkgeom"), (root / "migrations", "qkgeom/migrations")):
        if not top.is_dir():
            continue
        for p in sorted(top.rglob("*")):
            rel = p.relative_to(top)
            if p.is_file() and not any(part == "__pycache__" or part.endswith(".egg-info")
                                       for part in rel.parts) \
                    and p.suffix not in (".pyc", ".pyo") and rel.as_posix() != "_shipped.py":
                out.append((f"{prefix}/{rel.as_posix()}", p))
    if (root / "pyproject.toml").is_file():
        out.append(("pyproject.toml", root / "pyproject.toml"))
    return out


def content_hash(root: Path) -> str:
    """sha256 over the package sources under ``root`` (names and bytes), 16 hex digits."""
    h = hashlib.sha256()
    for name, p in sorted(_package_files(root)):
        data = p.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def _with_hash(version: str, digest: str) -> str:
    return f"{version}{'.' if '+' in version else '+'}h{digest}"  # a PEP 440 local label


def code_version() -> str:
    """The version of the code running now: ``__version__+h<content hash>``.

    From a shipped wheel, its stamped hash (the hash of the sources it was built from);
    otherwise the hash of the sources imported. ``__version__`` is read from the module
    actually imported, so an edited copy shows up even before hashing.
    """
    import qkgeom

    try:
        from qkgeom._shipped import CONTENT_HASH
    except ImportError:
        root = source_root() or Path(qkgeom.__file__).resolve().parent.parent
        CONTENT_HASH = content_hash(root)
    return _with_hash(qkgeom.__version__, CONTENT_HASH)


# ---------------------------------------------------------------------- the wheel
def build_wheel(out_dir: str | Path) -> Shipped:
    """Build a wheel of the running qkgeom into ``out_dir`` (offline; a few seconds).

    The sources are copied first, so the checkout gets no ``build/`` or ``*.egg-info``;
    the copy's version becomes ``__version__+h<hash>`` and it gains ``qkgeom/_shipped.py``.
    """
    import qkgeom

    root = source_root()
    if root is None:
        raise ShipError(
            f"qkgeom runs from {Path(qkgeom.__file__).parent}, not from a checkout: cannot "
            "build the wheel to ship; install qkgeom from its source (pip install -e DIR) "
            "and run qkgeom sweep --cluster from there")
    out = Path(out_dir)
    src = out / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    ignore = shutil.ignore_patterns(*_SKIP)
    shutil.copytree(root / "qkgeom", src / "qkgeom", ignore=ignore)
    if (root / "migrations").is_dir():
        shutil.copytree(root / "migrations", src / "migrations", ignore=ignore)
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        if (root / f).is_file():
            shutil.copy2(root / f, src / f)
    digest = content_hash(src)
    init = (src / "qkgeom" / "__init__.py").read_text()
    m = re.search(r'^__version__\s*=\s*"([^"]+)"', init, re.M)
    if not m:
        raise ShipError(f"{root / 'qkgeom' / '__init__.py'}: no __version__ = \"...\" line")
    version = _with_hash(m.group(1), digest)
    pp = src / "pyproject.toml"
    text, n = re.subn(r'^version\s*=\s*"[^"]*"', f'version = "{version}"', pp.read_text(),
                      count=1, flags=re.M)
    if not n:
        raise ShipError(f"{root / 'pyproject.toml'}: no static version = \"...\" line")
    pp.write_text(text)
    from qkgeom.sweeps.provenance import git_state

    commit, dirty = git_state(root)  # the checkout's: a node has none of its own
    (src / "qkgeom" / "_shipped.py").write_text(
        '"""Written by qkgeom.sweeps.ship.build_wheel: what this wheel was built from."""\n\n'
        f'VERSION = "{version}"\nCONTENT_HASH = "{digest}"\n'
        f'GIT_COMMIT = {commit!r}\nGIT_DIRTY = {dirty!r}\n')
    dist = out / "dist"
    dist.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)]
    import importlib.util

    if importlib.util.find_spec("setuptools") is not None:
        cmd.insert(4, "--no-build-isolation")  # offline: this environment's setuptools
    p = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dist.glob("qkgeom-*.whl"))
    if p.returncode != 0 or len(wheels) != 1:
        last = (p.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise ShipError(f"building the qkgeom wheel failed ({last}); try: "
                        f"{sys.executable} -m pip wheel --no-deps {root}")
    return Shipped(wheels[0], version, digest)


# ---------------------------------------------------------------------- the cluster file
def installs_qkgeom(command: str) -> bool:
    """Does this setup command install qkgeom (the shipped wheel, or from an index/URL)?"""
    return WHEEL_VAR in command or bool(
        re.search(r"\bpip3?\s+install\b[^;&|]*\bqkgeom\b", command))


def check_installs(cfg: dict[str, Any], where: str) -> None:
    """Refuse a cluster file in which some node would get no qkgeom."""
    docker = cfg.get("docker") or {}
    if any("qkgeom" in str(docker.get(k, "")) for k in ("image", "head_image")) and \
            any("qkgeom" in str(docker.get(k, "")) for k in ("image", "worker_image")):
        return
    common = [str(c) for c in cfg.get("setup_commands") or []]
    head = common + [str(c) for c in cfg.get("head_setup_commands") or []]
    worker = common + [str(c) for c in cfg.get("worker_setup_commands") or []]
    hint = ("add e.g. '~/qkgeom-venv/bin/pip install \"$QKGEOM_WHEEL\"' (the wheel that "
            "qkgeom sweep --cluster ships) to setup_commands, or use a docker.image with "
            "qkgeom")
    on_head, on_workers = any(map(installs_qkgeom, head)), any(map(installs_qkgeom, worker))
    if not on_head and not on_workers:
        raise ShipError(f"{where}: setup_commands: nothing installs qkgeom; {hint}")
    types = cfg.get("available_node_types") or {}
    has_workers = bool(cfg.get("max_workers", 1) if not types else any(
        t.get("max_workers", 1) for n, t in types.items() if n != cfg.get("head_node_type")))
    if not on_head:
        raise ShipError(f"{where}: head_setup_commands: nothing installs qkgeom on the head; "
                        f"{hint}")
    if has_workers and not on_workers:
        raise ShipError(f"{where}: worker_setup_commands: nothing installs qkgeom on the "
                        f"workers; {hint}")


def ships_wheel(cfg: dict[str, Any]) -> bool:
    return any(WHEEL_VAR in str(c) for k in ("setup_commands", "head_setup_commands",
                                             "worker_setup_commands")
               for c in cfg.get(k) or [])


def data_to_ship(data: str | None) -> Path | None:
    """The local corpus directory or file ``--data`` names, if any; refused when too large."""
    if not data:
        return None
    p = Path(data).expanduser()
    if not p.exists():
        return None  # a dataset name (wikitext-103) or a path on the nodes themselves
    p = p.resolve()
    size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() \
        else p.stat().st_size
    if size > MAX_DATA_BYTES:
        raise ShipError(
            f"--data {data}: {size / 2**20:.0f} MiB is too large to copy to every node "
            f"(limit {MAX_DATA_BYTES // 2**20} MiB); use --data wikitext-103 (each node "
            "downloads it; needs qkgeom[hf]) or a path that exists on the nodes")
    return p


def derive_cluster_config(cfg: dict[str, Any], shipped: Shipped | None,
                          data: Path | None) -> tuple[dict[str, Any], str | None]:
    """The cluster file qkgeom actually launches, and the corpus path on the nodes.

    Adds the wheel (under ``~/qkgeom-ship/``) and ``data`` (under ``~/qkgeom-data/``) to
    ``file_mounts``, and prefixes every setup command that mentions ``$QKGEOM_WHEEL`` with
    ``export QKGEOM_WHEEL=<the wheel on the node>;``. The user's file is not changed.
    """
    d = copy.deepcopy(cfg)
    mounts = dict(d.get("file_mounts") or {})
    if shipped is not None:
        remote = f"{REMOTE_SHIP}/{shipped.wheel.name}"
        mounts[remote] = str(shipped.wheel)
        for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
            if d.get(key):
                d[key] = [f"export {WHEEL_VAR}={remote}; {c}" if WHEEL_VAR in str(c) else c
                          for c in d[key]]
    remote_data = None
    if data is not None:
        remote_data = f"{REMOTE_DATA}/{data.name}"
        mounts[remote_data] = str(data)
    d["file_mounts"] = mounts
    return d, remote_data


def write_cluster_file(cfg: dict[str, Any], directory: str | Path, stem: str) -> Path:
    import yaml

    p = Path(directory) / f"{stem}.yaml"
    p.write_text("# derived by qkgeom sweep --cluster (file_mounts and setup commands ship "
                 "qkgeom); do not edit\n" + yaml.safe_dump(cfg, sort_keys=False))
    return p


# ---------------------------------------------------------------------- launcher errors
_CREDENTIAL_ERRORS = {
    "NoCredentialsError": "aws", "PartialCredentialsError": "aws",
    "NoRegionError": "aws", "DefaultCredentialsError": "gcp", "RefreshError": "gcp",
}
_AWS_AUTH_CODES = ("AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId",
                   "SignatureDoesNotMatch", "ExpiredToken", "RequestExpired",
                   "AccessDenied", "UnrecognizedClientException")
_FIX = {
    "aws": "configure AWS credentials (aws configure, or AWS_ACCESS_KEY_ID/"
           "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) with EC2 and IAM rights, then rerun",
    "gcp": "log in with gcloud auth application-default login (or set "
           "GOOGLE_APPLICATION_CREDENTIALS to a service-account key), then rerun",
}
_MISSING_SDK = {"boto3": ("aws", "boto3"), "botocore": ("aws", "boto3"),
                "googleapiclient": ("gcp", "google-api-python-client"),
                "google": ("gcp", "google-api-python-client")}


def credentials_error(e: BaseException, cluster_file: str) -> str | None:
    """One line for a cloud-credentials (or missing cloud SDK) failure of ``ray up``."""
    for exc in (e, e.__cause__, e.__context__):
        if exc is None:
            continue
        name = type(exc).__name__
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in \
                _MISSING_SDK:
            cloud, pkg = _MISSING_SDK[(exc.name or "").split(".")[0]]
            return (f"ray up {cluster_file}: the {cloud} cluster launcher needs {pkg}; "
                    f"pip install {pkg}")
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
        if name in _CREDENTIAL_ERRORS:
            return (f"ray up {cluster_file}: {_CREDENTIAL_ERRORS[name]} credentials: {text}; "
                    f"{_FIX[_CREDENTIAL_ERRORS[name]]}")
        if name == "ClientError" and any(c in str(exc) for c in _AWS_AUTH_CODES):
            return f"ray up {cluster_file}: aws refused the credentials: {text}; {_FIX['aws']}"
    return None
