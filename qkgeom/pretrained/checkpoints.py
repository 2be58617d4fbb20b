"""qkgeom's own checkpoints as a pretrained family: finding them, loading them, measuring.

``--checkpoints`` names a directory (path or ``s3://``/``gs://``/``file://`` URI) of
``step_N/`` checkpoints or a ``SWEEP/TRIAL_KEY`` looked up in the results database; each
checkpoint's GPT is measured with the same streaming metrics as a transformers model.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qkgeom.engine import metrics as M
from qkgeom.engine.hooks import capture_outputs
from qkgeom.engine.probe import weight_rows
from qkgeom.pretrained.accumulate import GeometryAccumulator
from qkgeom.pretrained.base import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_ERANK_SEQS,
    DEFAULT_MAX_TOKENS,
    Measurement,
    PretrainedError,
    TokenProgress,
)
from qkgeom.pretrained.text import batches, text_windows

if TYPE_CHECKING:
    from qkgeom.store import Store


def revision_step(revision: str) -> int | None:
    """The training step a revision name encodes (``step3000``, ``step_0003000``), or None."""
    m = re.fullmatch(r"(?:.*[^0-9])?step[_-]?(\d+)", revision)
    return int(m.group(1)) if m else None


def _is_uri(loc: str | Path) -> bool:
    return isinstance(loc, str) and "://" in loc


def _fs(uri: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception as e:  # unknown scheme, missing credentials, bad bucket name
        raise PretrainedError(f"cannot open {uri}: {str(e).strip().splitlines()[0]}") from None


def _state_exists(loc: str | Path) -> bool:
    """Whether a checkpoint/snapshot directory (path or URI) holds a ``state.pt``."""
    from qkgeom.engine.train import STATE_FILE

    if not _is_uri(loc):
        return (Path(loc) / STATE_FILE).is_file()
    import pyarrow.fs as pafs

    fs, path = _fs(str(loc))
    try:
        return fs.get_file_info(f"{path.rstrip('/')}/{STATE_FILE}").type == pafs.FileType.File
    except OSError:
        return False


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path | str]]:
    """``(step, dir)`` of qkgeom checkpoints under ``root`` (or ``root`` itself), by step.

    ``root`` may be a URI (``s3://...``, ``gs://...``, ``file://...``): the directories are
    then listed through its ``pyarrow.fs`` filesystem and returned as URIs.
    """
    from qkgeom.engine.train import STATE_FILE

    if _is_uri(root):
        import pyarrow.fs as pafs

        uri = str(root).rstrip("/")
        if _state_exists(uri):
            step = revision_step(uri.rsplit("/", 1)[-1])
            return [(step if step is not None else -1, uri)]
        fs, path = _fs(uri)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except OSError as e:
            raise PretrainedError(f"cannot list {uri}: {e}") from None
        found: list[tuple[int, Path | str]] = []
        for info in infos:
            st = revision_step(info.base_name)
            if info.type == pafs.FileType.Directory and st is not None \
                    and _state_exists(f"{uri}/{info.base_name}"):
                found.append((st, f"{uri}/{info.base_name}"))
        return sorted(found, key=lambda x: x[0])
    root = Path(root).expanduser()
    if (root / STATE_FILE).is_file():
        step = revision_step(root.name)
        return [(step if step is not None else -1, root)]
    out: list[tuple[int, Path | str]] = []
    if root.is_dir():
        for d in root.iterdir():
            st = revision_step(d.name)
            if d.is_dir() and st is not None and (d / STATE_FILE).is_file():
                out.append((st, d))
    return sorted(out, key=lambda x: x[0])


def resolve_checkpoints(spec: str, store: Store | None,
                        note: Callable[[str], None] | None = None
                        ) -> tuple[str, list[tuple[int, Path | str]]]:
    """``(model id, [(step, location)])`` for ``--checkpoints``: a directory (path or URI)
    or ``SWEEP/TRIAL_KEY``.

    A directory gives model id ``qkgeom:<dir>``; a sweep/trial (looked up in the database's
    ``checkpoints`` table) gives ``qkgeom:SWEEP/TRIAL_KEY``: per step its weight snapshot,
    else a resume checkpoint of that step while one still exists. Locations that are URIs
    are read through their ``pyarrow.fs`` filesystem (S3, GCS, ``file://``). A recorded
    snapshot that cannot be found is an error; resume rows a pre-0003 sweep left behind
    after pruning are skipped (told through ``note``).
    """
    if _is_uri(spec):
        found = checkpoint_dirs(spec)
        if not found:
            raise PretrainedError(f"no qkgeom checkpoints (step_N/state.pt) under {spec}")
        return f"qkgeom:{spec.rstrip('/')}", found
    p = Path(spec).expanduser()
    if p.is_dir():
        found = checkpoint_dirs(p)
        if not found:
            raise PretrainedError(f"no qkgeom checkpoints (step_N/state.pt) under {p}")
        return f"qkgeom:{p.resolve()}", found
    if "/" not in spec:
        raise PretrainedError(f"--checkpoints {spec!r} is neither a directory nor SWEEP/TRIAL_KEY")
    if store is None:
        raise PretrainedError("--checkpoints SWEEP/TRIAL_KEY needs the results database (--db)")
    sweep, key = spec.split("/", 1)
    recorded = store.trial_checkpoints(sweep, key)
    if not recorded:
        raise PretrainedError(f"no checkpoints recorded for trial {key!r} of sweep {sweep!r}; "
                              "list trials with `qkgeom status --name SWEEP` or pass a checkpoint directory")
    by_step: dict[int, list[tuple[str, str]]] = {}
    for st, kind, loc in recorded:
        by_step.setdefault(st, []).append((kind, loc))
    found: list[tuple[int, Path | str]] = []
    missing: list[str] = []
    pruned: list[int] = []
    for st in sorted(by_step):
        rows = sorted(by_step[st], key=lambda r: r[0] != "snapshot")  # snapshot first
        hit = next((loc for _, loc in rows if _state_exists(loc)), None)
        if hit is not None:
            found.append((st, hit if _is_uri(hit) else Path(hit)))
        elif any(kind == "snapshot" for kind, _ in rows):
            missing += [loc for kind, loc in rows if kind == "snapshot"]
        else:
            pruned.append(st)
    if missing or not found:
        shown = missing or [loc for rows in by_step.values() for _, loc in rows]
        raise PretrainedError(f"checkpoint directories not found on this machine: "
                              f"{', '.join(shown[:3])}"
                              f"{f' (and {len(shown) - 3} more)' if len(shown) > 3 else ''}; "
                              "copy them here (same paths) or pass a directory")
    if pruned and note is not None:
        note(f"{spec}: steps {', '.join(map(str, pruned))} have only resume checkpoints that "
             "were pruned (a sweep from before snapshots were kept); measuring the "
             f"{len(found)} other step(s)")
    return f"qkgeom:{spec}", found


def _read_state(directory: str | Path, device: str) -> dict:
    import io

    from qkgeom.engine.train import STATE_FILE

    if _is_uri(directory):
        fs, path = _fs(str(directory))
        where = f"{str(directory).rstrip('/')}/{STATE_FILE}"
        try:
            with fs.open_input_file(f"{path.rstrip('/')}/{STATE_FILE}") as f:
                data = f.read()
            return torch.load(io.BytesIO(data), map_location=device, weights_only=False)
        except (OSError, RuntimeError) as e:
            raise PretrainedError(f"cannot read checkpoint {where}: {e}") from None
    path = Path(directory) / STATE_FILE
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except (OSError, RuntimeError) as e:
        raise PretrainedError(f"cannot read checkpoint {path}: {e}") from None


def load_checkpoint(directory: str | Path, device: str = "cpu") -> tuple[Any, list[str], dict]:
    """``(GPT in eval mode, chars, config dict)`` from a qkgeom checkpoint or weight snapshot
    directory (a path, or a URI read through ``pyarrow.fs``)."""
    from qkgeom.config import TrialConfig
    from qkgeom.engine.model import GPT

    state = _read_state(directory, device)
    cfg = TrialConfig.from_dict(state["config"])
    model = GPT(cfg, len(state["chars"]) + 1)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), list(state["chars"]), state["config"]


def measure_gpt(model: Any, chars: Sequence[str], text: str, *,
                max_tokens: int | None = DEFAULT_MAX_TOKENS,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, erank_seqs: int = DEFAULT_ERANK_SEQS,
                progress: TokenProgress | None = None) -> Measurement:
    """The same metrics for qkgeom's own character-level GPT (context ``block_size``)."""
    from qkgeom.engine.data import UNK

    lut = {c: i + 1 for i, c in enumerate(chars)}
    n = len(text) if max_tokens is None else min(len(text), max_tokens)
    ids = [lut.get(c, UNK) for c in text[:n]]
    seq_len = model.cfg.block_size
    seqs = text_windows(ids, seq_len)
    bs = max(1, chunk_tokens // seq_len)
    device = next(model.parameters()).device
    acc = GeometryAccumulator(erank_seqs=erank_seqs)
    layers = model.attn_layers()
    points = {(li, name): getattr(a, f"hook_{name}")
              for li, a in enumerate(layers) for name in ("q", "k")}
    t0 = time.perf_counter()
    done = 0
    with capture_outputs(points) as cur, torch.no_grad():
        for x, am in batches(seqs, bs, UNK):
            cur.clear()
            model(x.to(device))
            t = x.shape[1]
            real = am.bool().to(device)
            vis = M.causal_visible(t, device=device)[None, None]  # (1, 1, T, T)
            for li in range(len(layers)):
                q, k = cur[li, "q"], cur[li, "k"]  # (B, nh, T, hs)
                acc.update(li, q, k, vis, q.shape[-1] ** -0.5, real=real)
            done += int(am.sum())
            if progress is not None:
                el = time.perf_counter() - t0
                progress(done, n, {"tokens_per_s": done / max(el, 1e-9)})
    wall = time.perf_counter() - t0
    cfg = model.cfg
    meta = dict(source="qkgeom", n_layers=cfg.n_layer, n_heads=cfg.n_head,
                n_kv_heads=cfg.n_head, d_head=cfg.d_head, d_model=cfg.n_embd, text_tokens=n,
                tokens=done, sequences=len(seqs), seq_len=seq_len, chunk_tokens=bs * seq_len,
                erank_seqs=min(erank_seqs, len(seqs)), rotary=False, wall_s=wall,
                tokens_per_s=done / max(wall, 1e-9))
    return Measurement(weight_rows(model) + acc.rows(), meta)
