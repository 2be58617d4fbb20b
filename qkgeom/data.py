"""Character-level corpora: locate, (download,) encode once, memory-map, sample batches.

Sources, in the order ``resolve_source`` tries them:

* ``"default"``: the directory or file in ``$QKGEOM_DATA`` if set, else ``wikitext-103``.
* a directory holding ``wiki.{train,valid,test}.raw``. With only ``valid`` and ``test``
  present (the offline copy in ``shared/data/wikitext``) we train on ``valid`` and evaluate
  on ``test``, and :attr:`Corpus.note` says so (it is stored with every run).
* a single text file: split by characters 90% / 5% / 5% into train / val / test.
* ``wikitext-103`` or ``wikitext-2``: the raw WikiText corpus through the ``datasets``
  library (extra ``hf``), written once as ``wiki.*.raw`` under the cache directory.

The vocabulary comes from the training text; characters unseen in training map to id 0
(``UNK``). The encoded splits are cached as ``.npy`` files keyed by a content hash and
opened with ``mmap_mode="r"``, so many Ray workers on one node share the pages.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qkgeom.errors import DataError

HUB_CONFIGS = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}
UNK = 0


def cache_dir() -> Path:
    """``$QKGEOM_CACHE`` or ``~/.cache/qkgeom``."""
    return Path(os.environ.get("QKGEOM_CACHE", Path.home() / ".cache" / "qkgeom"))


def default_source() -> str:
    return os.environ.get("QKGEOM_DATA") or "wikitext-103"


@dataclass
class Corpus:
    train: np.ndarray  # uint16 ids, memory-mapped
    val: np.ndarray
    test: np.ndarray
    chars: list[str]  # id i+1 -> chars[i]; id 0 is UNK
    note: str  # where the splits came from, stored in the run's metadata
    key: str  # content hash of the source text

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return "".join(self.chars[i - 1] if i > 0 else "\ufffd" for i in ids)


def _read(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}; check --data") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text; pass a text corpus with --data") from None
    return text


def _split_texts(source: str) -> tuple[str, str, str, str]:
    """Return (train, val, test, note) texts for a source string."""
    if source == "default":
        source = default_source()
    if source in HUB_CONFIGS:
        return _split_texts(str(_download(source)))
    path = Path(source).expanduser()
    if path.is_dir():
        f = {s: path / f"wiki.{s}.raw" for s in ("train", "valid", "test")}
        if f["train"].exists():
            tr, va, te = _read(f["train"]), _read(f["valid"]), _read(f["test"])
            note = f"train/valid/test = wiki.{{train,valid,test}}.raw in {path}"
        elif f["valid"].exists() and f["test"].exists():
            tr, te = _read(f["valid"]), _read(f["test"])
            va = te
            note = (f"no training split in {path}: trained on wiki.valid.raw; validation and "
                    "test losses on wiki.test.raw")
        else:
            raise DataError(
                f"{path} holds no wiki.train.raw or wiki.valid.raw + wiki.test.raw; "
                "pass --data with a WikiText directory or a text file"
            )
    elif path.is_file():
        text = _read(path)
        n = len(text)
        a, b = int(n * 0.90), int(n * 0.95)
        tr, va, te = text[:a], text[a:b], text[b:]
        note = f"single file {path}: characters split 90/5/5 into train/val/test"
    else:
        raise DataError(
            f"no corpus at {source!r}: pass --data PATH (a directory with wiki.*.raw files or "
            "a text file), set QKGEOM_DATA, or use --data wikitext-103 with network access"
        )
    for name, t in (("training", tr), ("evaluation", te)):
        if not t.strip():
            raise DataError(f"the {name} text of {source!r} is empty; check --data")
    return tr, va, te, note


def _download(name: str) -> Path:
    """Fetch raw WikiText through ``datasets`` once; return the directory of .raw files."""
    out = cache_dir() / name
    if (out / "wiki.train.raw").exists():
        return out
    hint = ("pass --data PATH to a local copy (a directory with wiki.*.raw files, e.g. "
            "shared/data/wikitext) or set QKGEOM_DATA")
    try:
        import datasets  # noqa: PLC0415  (optional extra "hf")
    except ImportError:
        raise DataError(f"{name} needs the 'datasets' package (pip install "
                        f"'qkgeom[hf]') and network access; or {hint}") from None
    try:
        ds = datasets.load_dataset("Salesforce/wikitext", HUB_CONFIGS[name])
    except Exception as e:  # offline: ConnectionError, hub errors, ...
        raise DataError(f"could not download {name} ({type(e).__name__}); {hint}") from None
    out.mkdir(parents=True, exist_ok=True)
    for split, fname in (("train", "train"), ("validation", "valid"), ("test", "test")):
        tmp = out / f"wiki.{fname}.raw.tmp"
        with tmp.open("w", encoding="utf-8") as fh:
            for row in ds[split]["text"]:
                fh.write(row if row else " \n")
        tmp.replace(out / f"wiki.{fname}.raw")
    return out


def load_corpus(source: str = "default") -> Corpus:
    """Load (and on first use encode and cache) the corpus named by ``source``."""
    tr, va, te, note = _split_texts(source)
    h = hashlib.sha256()
    for t in (tr, va, te):
        h.update(hashlib.sha256(t.encode()).digest())
    key = h.hexdigest()[:20]
    d = cache_dir() / "encoded" / key
    meta = d / "meta.json"
    if not meta.exists():
        chars = sorted(set(tr))
        if len(chars) + 1 > np.iinfo(np.uint16).max:
            raise DataError("training text has more than 65,534 distinct characters")
        lut = {c: i + 1 for i, c in enumerate(chars)}
        d.mkdir(parents=True, exist_ok=True)
        for split, text in (("train", tr), ("val", va), ("test", te)):
            ids = np.fromiter((lut.get(c, UNK) for c in text), dtype=np.uint16, count=len(text))
            tmp = d / f"{split}.tmp.npy"
            np.save(tmp, ids)
            tmp.replace(d / f"{split}.npy")
        tmp = d / "meta.tmp"
        tmp.write_text(json.dumps({"chars": chars, "note": note}))
        tmp.replace(meta)  # written last: a crash mid-encode leaves no half cache
    m = json.loads(meta.read_text())
    arrs = {s: np.load(d / f"{s}.npy", mmap_mode="r") for s in ("train", "val", "test")}
    return Corpus(arrs["train"], arrs["val"], arrs["test"], m["chars"], note, key)


def unigram_entropy(ids: np.ndarray) -> float:
    """Entropy (nats/char) of the character distribution of ``ids``."""
    counts = np.bincount(np.asarray(ids, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class Sampler:
    """Random contiguous windows of a split, from a seeded generator whose state is saved."""

    def __init__(self, data: np.ndarray, block_size: int, batch_size: int, seed: int) -> None:
        if len(data) <= block_size + 1:
            raise DataError(
                f"a split of {len(data)} characters is too short for block_size {block_size}"
            )
        self.data, self.block, self.batch = data, block_size, batch_size
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, both ``(batch, block)`` int64; ``y`` is ``x`` shifted by one."""
        starts = self.rng.integers(0, len(self.data) - self.block - 1, size=self.batch)
        return windows(self.data, starts, self.block, device)

    def state_dict(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["bit_generator"]


def windows(
    data: np.ndarray, starts: np.ndarray, block: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(block + 1)[None, :]  # (B, block + 1)
    arr = torch.from_numpy(np.asarray(data[idx], dtype=np.int64))
    x, y = arr[:, :-1], arr[:, 1:]
    if str(device) != "cpu":
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x, y


def fixed_starts(data: np.ndarray, block: int, n: int, seed: int) -> np.ndarray:
    """Start offsets of a fixed batch: the same windows for every trial sharing ``seed``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.integers(0, len(data) - block - 1, size=n)
