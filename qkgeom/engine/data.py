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

The cache, under :func:`cache_dir`:

* ``sources/<id>.json``: per source (its kind and resolved file paths), the files' identity
  (size, mtime, ctime, inode) when they were hashed, the split lengths and digests, and the
  content key. A cached open stats the files, reads this record and memory-maps the arrays;
  it never reads the text. A file whose identity changed is hashed again (and encoded again
  only if its content changed). A file changed within ``_RACY_NS`` of being hashed could
  change again without its identity changing, so such a record is re-checked on next use.
* ``encoded/<key>/{train,val,test}.npy`` + ``meta.json``: the ids and the vocabulary,
  published as a whole directory by one atomic rename; sources with the same text share it.
* ``locks/``: ``filelock`` locks, so that however many processes start at once, one hashes,
  encodes or downloads and the others wait and then open its result.

Texts are streamed in blocks of ``_BLOCK`` bytes and encoded through a code-point
lookup table, so memory stays bounded whatever the corpus size.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from filelock import FileLock

from qkgeom.atomic import atomic_path
from qkgeom.errors import DataError

if TYPE_CHECKING:  # torch is imported where batches are made: opening a corpus is light
    import torch

HUB_CONFIGS = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}
UNK = 0
SPLITS = ("train", "val", "test")
_BLOCK = 1 << 21  # bytes per streamed block (a few tens of MB of working memory)
_N_CODE_POINTS = 0x110000
_RACY_NS = 2_000_000_000  # identity of a file changed this recently is not trusted
_RECORD_VERSION = 1


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


# ---------------------------------------------------------------- reading
def _blocks(path: Path) -> Iterator[str]:
    """The text of ``path`` as ``read_text`` decodes it, in blocks of up to ``_BLOCK`` bytes.

    Universal newlines as in text mode (``\r\n`` and ``\r`` become ``\n``), done here
    because ``TextIOWrapper`` decodes about 3 times slower.
    """
    dec = codecs.getincrementaldecoder("utf-8")()
    cr = False  # a block ended in "\r": is it the first half of "\r\n"?
    try:
        with open(path, "rb") as fh:
            while True:
                raw = fh.read(_BLOCK)
                text = dec.decode(raw, final=not raw)
                if cr:
                    text, cr = "\r" + text, False
                if "\r" in text:
                    if raw and text.endswith("\r"):
                        text, cr = text[:-1], True
                    text = text.replace("\r\n", "\n").replace("\r", "\n")
                if text:
                    yield text
                if not raw:
                    break
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}; check --data") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text; pass a text corpus with --data") from None


def _pieces(path: Path, cuts: list[int]) -> Iterator[tuple[int, str]]:
    """``(range index, text)`` pieces of ``path`` cut at the character offsets ``cuts``."""
    pos, i = 0, 0
    for chunk in _blocks(path):
        off = 0
        while off < len(chunk):
            while i < len(cuts) and pos + off >= cuts[i]:
                i += 1
            end = len(chunk) if i == len(cuts) else min(len(chunk), cuts[i] - pos)
            yield i, chunk[off:end]
            off = end
        pos += len(chunk)


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def _identity(path: Path) -> list:
    """What a cached open compares instead of reading the file."""
    try:
        st = path.stat()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}; check --data") from None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


# ---------------------------------------------------------------- sources
@dataclass(frozen=True)
class _Layout:
    """Which raw files make the three splits."""

    source: str  # as resolved, for messages
    files: tuple[Path, ...]  # resolved paths
    single: bool  # one file, split 90/5/5 by characters
    splits: tuple[tuple[int, int], ...]  # (file index, range index) of train, val, test
    note: str

    @property
    def id(self) -> str:
        desc = json.dumps({"single": self.single, "files": [str(f) for f in self.files]})
        return hashlib.sha256(desc.encode()).hexdigest()[:20]


def _layout(source: str) -> _Layout:
    if source == "default":
        source = default_source()
    if source in HUB_CONFIGS:
        source = str(download(source))
    path = Path(source).expanduser()
    if path.is_dir():
        f = {s: path / f"wiki.{s}.raw" for s in ("train", "valid", "test")}
        if f["train"].exists():
            files = (f["train"], f["valid"], f["test"])
            splits = ((0, 0), (1, 0), (2, 0))
            note = f"train/valid/test = wiki.{{train,valid,test}}.raw in {path}"
        elif f["valid"].exists() and f["test"].exists():
            files, splits = (f["valid"], f["test"]), ((0, 0), (1, 0), (1, 0))
            note = (f"no training split in {path}: trained on wiki.valid.raw; validation and "
                    "test losses on wiki.test.raw")
        else:
            raise DataError(
                f"{path} holds no wiki.train.raw or wiki.valid.raw + wiki.test.raw; "
                "pass --data with a WikiText directory or a text file"
            )
        return _Layout(source, tuple(p.resolve() for p in files), False, splits, note)
    if path.is_file():
        note = f"single file {path}: characters split 90/5/5 into train/val/test"
        return _Layout(source, (path.resolve(),), True, ((0, 0), (0, 1), (0, 2)), note)
    raise DataError(
        f"no corpus at {source!r}: pass --data PATH (a directory with wiki.*.raw files or "
        "a text file), set QKGEOM_DATA, or use --data wikitext-103 with network access"
    )


def _scan(layout: _Layout) -> tuple[dict, np.ndarray]:
    """Hash the splits' texts (one pass per file; two for a single file) into a record.

    Returns the record and the vocabulary (sorted code points of the training text).
    """
    t0 = time.time_ns()
    idents = [_identity(f) for f in layout.files]  # before reading: a change shows later
    cuts, digests, lengths, nonblank = [], [], [], []
    seen = np.zeros(_N_CODE_POINTS, dtype=bool)
    for fi, f in enumerate(layout.files):
        c: list[int] = []
        if layout.single:
            n = sum(len(chunk) for chunk in _blocks(f))
            c = [int(n * 0.90), int(n * 0.95)]
        hs = [hashlib.sha256() for _ in range(len(c) + 1)]
        ln, nb = [0] * len(hs), [False] * len(hs)
        for i, piece in _pieces(f, c):
            hs[i].update(piece.encode())
            ln[i] += len(piece)
            nb[i] = nb[i] or bool(piece.strip())
            if (fi, i) == layout.splits[0]:
                seen[_code_points(piece)] = True
        cuts.append(c)
        digests.append([h.hexdigest() for h in hs])
        lengths.append(ln)
        nonblank.append(nb)
    for name, (fi, ri) in (("training", layout.splits[0]), ("evaluation", layout.splits[2])):
        if not nonblank[fi][ri]:
            raise DataError(f"the {name} text of {layout.source!r} is empty; check --data")
    # today's key: sha256 over the three split texts' sha256 digests
    h = hashlib.sha256()
    for fi, ri in layout.splits:
        h.update(bytes.fromhex(digests[fi][ri]))
    racy = any(max(m, c) >= t0 - _RACY_NS for _, m, c, _ in idents)
    return {"version": _RECORD_VERSION, "files": [str(f) for f in layout.files],
            "identity": idents, "cuts": cuts, "lengths": lengths, "digests": digests,
            "key": h.hexdigest()[:20], "racy": racy}, np.flatnonzero(seen)


def _record_holds(rec: dict | None, layout: _Layout) -> bool:
    return (rec is not None and rec.get("version") == _RECORD_VERSION and not rec["racy"]
            and rec["identity"] == [_identity(f) for f in layout.files])


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _publish_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w") as fh:
        json.dump(obj, fh)


def _lock(name: str) -> FileLock:
    d = cache_dir() / "locks"
    d.mkdir(parents=True, exist_ok=True)
    return FileLock(d / f"{name}.lock")


# ---------------------------------------------------------------- encoding
def _write_npy_header(fh, n: int) -> None:
    # what np.save writes for a 1-D uint16 array of length n
    np.lib.format.write_array_header_1_0(
        fh, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint16)),
             "fortran_order": False, "shape": (n,)})


def _vocabulary(layout: _Layout, rec: dict) -> np.ndarray:
    ftr, rtr = layout.splits[0]
    seen = np.zeros(_N_CODE_POINTS, dtype=bool)
    for i, piece in _pieces(layout.files[ftr], rec["cuts"][ftr]):
        if i > rtr:
            break
        if i == rtr:
            seen[_code_points(piece)] = True
    return np.flatnonzero(seen)


def _encode(layout: _Layout, rec: dict, d: Path, vocab: np.ndarray | None) -> None:
    """Write ``d`` (ids of the three splits + vocabulary) by streaming the raw files.

    ``vocab``: the sorted code points of the training text (== ``sorted(set(train))``),
    if a scan just found them.
    """
    if vocab is None:
        vocab = _vocabulary(layout, rec)
    if len(vocab) + 1 > np.iinfo(np.uint16).max:
        raise DataError("training text has more than 65,534 distinct characters")
    lut = np.zeros(_N_CODE_POINTS, dtype=np.uint16)  # code point -> id; unseen -> UNK
    lut[vocab] = np.arange(1, len(vocab) + 1, dtype=np.uint16)
    d.parent.mkdir(parents=True, exist_ok=True)
    # the whole directory at once; one already at d is an incomplete one left by a crash
    with atomic_path(d, directory=True) as tmp:
        for fi, f in enumerate(layout.files):
            outs: dict[int, list] = {}
            for split, (sf, sr) in zip(SPLITS, layout.splits):
                if sf == fi:
                    fh = open(tmp / f"{split}.npy", "wb")  # closed below
                    _write_npy_header(fh, rec["lengths"][fi][sr])
                    outs.setdefault(sr, []).append(fh)
            written = [0] * len(rec["lengths"][fi])
            try:
                for i, piece in _pieces(f, rec["cuts"][fi]):
                    if i in outs:
                        ids = lut[_code_points(piece)]
                        written[i] += len(ids)
                        for fh in outs[i]:
                            ids.tofile(fh)
            finally:
                for fhs in outs.values():
                    for fh in fhs:
                        fh.close()
            if written != [n if i in outs else 0 for i, n in enumerate(rec["lengths"][fi])] \
                    or _identity(f) != rec["identity"][fi]:
                raise DataError(f"{f} changed while it was being encoded; run again")
        chars = [chr(c) for c in vocab]
        (tmp / "meta.json").write_text(json.dumps({"chars": chars, "note": layout.note}))


def _open(key: str, note: str) -> Corpus | None:
    d = cache_dir() / "encoded" / key
    m = _read_json(d / "meta.json")
    if m is None:
        return None
    arrs = {s: np.load(d / f"{s}.npy", mmap_mode="r") for s in SPLITS}
    return Corpus(arrs["train"], arrs["val"], arrs["test"], m["chars"], note, key)


def download(name: str) -> Path:
    """Fetch raw WikiText through ``datasets`` once; return the directory of .raw files.

    One process per machine downloads (a lock); each file is written under a unique
    temporary name and renamed into place, ``wiki.train.raw`` last, so its presence means
    the download is complete.
    """
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
    with _lock(f"download-{name}"):
        if (out / "wiki.train.raw").exists():  # another process finished it meanwhile
            return out
        try:
            ds = datasets.load_dataset("Salesforce/wikitext", HUB_CONFIGS[name])
        except Exception as e:  # offline: ConnectionError, hub errors, ...
            raise DataError(f"could not download {name} ({type(e).__name__}); {hint}") from None
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as publish:
            # renamed in the reverse order of entering, when all three are written
            tmps = {fname: publish.enter_context(atomic_path(out / f"wiki.{fname}.raw"))
                    for fname in ("train", "test", "valid")}
            for split, fname in (("train", "train"), ("validation", "valid"), ("test", "test")):
                with open(tmps[fname], "w", encoding="utf-8") as fh:
                    for row in ds[split]["text"]:
                        fh.write(row if row else " \n")
    return out


def load_corpus(source: str = "default") -> Corpus:
    """Load (and on first use hash, encode and cache) the corpus named by ``source``.

    Safe to call from many processes at once on a fresh cache: one does the work, the
    others wait for it. A cached open reads no text (see the module docstring).
    """
    layout = _layout(source)
    rec_path = cache_dir() / "sources" / f"{layout.id}.json"
    rec = _read_json(rec_path)
    if _record_holds(rec, layout):
        corpus = _open(rec["key"], layout.note)
        if corpus is not None:
            return corpus
    try:
        with _lock(f"source-{layout.id}"):
            rec = _read_json(rec_path)
            fresh, vocab = not _record_holds(rec, layout), None
            if fresh:
                rec, vocab = _scan(layout)
            d = cache_dir() / "encoded" / rec["key"]
            if not (d / "meta.json").exists():
                with _lock(f"encode-{rec['key']}"):
                    if not (d / "meta.json").exists():
                        _encode(layout, rec, d, vocab)
            if fresh:
                _publish_json(rec_path, rec)
    except OSError as e:  # reading the sources raises DataError: this is the cache
        raise DataError(f"cannot write the corpus cache {cache_dir()}: {e.strerror or e}; "
                        "set QKGEOM_CACHE to a writable directory") from None
    corpus = _open(rec["key"], layout.note)
    if corpus is None:
        raise DataError(f"the encoded corpus {rec['key']} vanished from {cache_dir()} while "
                        "it was being opened; run again")
    return corpus


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
    import torch

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
