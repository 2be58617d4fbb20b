"""Corpus preparation: first-use encoding and cached open, before (issue 16) vs now.

    python benchmarks/corpus.py [--sizes 50,500] [--old-max 50] [--repeats 3]
                                [--workdir ~/.cache/qkgeom-bench/corpus]

For each size N (millions of characters) it builds a synthetic WikiText directory whose
``wiki.train.raw`` is the shared WikiText text (``$QKGEOM_DATA`` or ../shared/data/wikitext,
valid + test) repeated to N characters, with the shared ``wiki.valid.raw`` and
``wiki.test.raw`` as valid/test. Then, each in a fresh subprocess with its own cache:

* ``encode``: ``load_corpus`` on an empty cache (read, hash, build the vocabulary, encode,
  write the ``.npy`` files);
* ``open``: ``load_corpus`` on the filled cache (median of ``--repeats`` processes).

Seconds are wall time of the ``load_corpus`` call alone (imports excluded); memory is the
call's extra peak resident memory (``VmHWM`` after the call minus ``VmRSS`` before it, with
the high-water mark reset through ``/proc/self/clear_refs`` first). ``old`` is the code of
``qkgeom/engine/data.py`` before issue 16, copied below (``old_load_corpus``); it runs only for sizes
up to ``--old-max`` (it holds whole texts in memory and loops over characters in Python).
Ratios are old / new, from the same run. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------- baseline: qkgeom/engine/data.py before issue 16
def _old_read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _old_split_texts(path: Path) -> tuple[str, str, str, str]:
    """The directory branch of the old ``_split_texts`` (the one this benchmark uses)."""
    f = {s: path / f"wiki.{s}.raw" for s in ("train", "valid", "test")}
    tr, va, te = _old_read(f["train"]), _old_read(f["valid"]), _old_read(f["test"])
    note = f"train/valid/test = wiki.{{train,valid,test}}.raw in {path}"
    for name, t in (("training", tr), ("evaluation", te)):
        if not t.strip():
            raise ValueError(f"the {name} text of {path} is empty")
    return tr, va, te, note


def old_load_corpus(source: str) -> tuple:
    """``load_corpus`` before issue 16 (returns the arrays, chars and key)."""
    from qkgeom.engine.data import cache_dir

    tr, va, te, note = _old_split_texts(Path(source))
    h = hashlib.sha256()
    for t in (tr, va, te):
        h.update(hashlib.sha256(t.encode()).digest())
    key = h.hexdigest()[:20]
    d = cache_dir() / "encoded" / key
    meta = d / "meta.json"
    if not meta.exists():
        chars = sorted(set(tr))
        lut = {c: i + 1 for i, c in enumerate(chars)}
        d.mkdir(parents=True, exist_ok=True)
        for split, text in (("train", tr), ("val", va), ("test", te)):
            ids = np.fromiter((lut.get(c, 0) for c in text), dtype=np.uint16, count=len(text))
            tmp = d / f"{split}.tmp.npy"
            np.save(tmp, ids)
            tmp.replace(d / f"{split}.npy")
        tmp = d / "meta.tmp"
        tmp.write_text(json.dumps({"chars": chars, "note": note}))
        tmp.replace(meta)
    m = json.loads(meta.read_text())
    arrs = {s: np.load(d / f"{s}.npy", mmap_mode="r") for s in ("train", "val", "test")}
    return arrs["train"], arrs["val"], arrs["test"], m["chars"], key


# ------------------------------------------------- one measurement (child process)
def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def child(impl: str, corpus: str) -> None:
    from qkgeom.engine.data import load_corpus

    fn = old_load_corpus if impl == "old" else load_corpus
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak to the current resident size
    before = _status()["VmRSS"]
    t0 = time.perf_counter()
    res = fn(corpus)
    dt = time.perf_counter() - t0
    peak = _status()["VmHWM"]
    key = res[-1] if impl == "old" else res.key
    n = len(res[0]) if impl == "old" else len(res.train)
    print(json.dumps({"s": dt, "extra_mib": (peak - before) / 2**20, "key": key, "n": n}))


def measure(impl: str, corpus: Path, cache: Path) -> dict:
    env = dict(os.environ, QKGEOM_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__, "--child", impl, str(corpus)], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{impl} on {corpus} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------- driver
def build(size_m: int, data: Path, workdir: Path) -> Path:
    d = workdir / f"wt{size_m}M"
    n = size_m * 1_000_000
    train = d / "wiki.train.raw"
    if not (train.exists() and (d / "chars").exists()
            and (d / "chars").read_text() == str(n)):
        d.mkdir(parents=True, exist_ok=True)
        base = "".join((data / f).read_text(encoding="utf-8")
                       for f in ("wiki.valid.raw", "wiki.test.raw"))
        reps, rest = divmod(n, len(base))
        with open(train, "w", encoding="utf-8") as fh:
            for _ in range(reps):
                fh.write(base)
            fh.write(base[:rest])
        for f in ("wiki.valid.raw", "wiki.test.raw"):
            shutil.copyfile(data / f, d / f)
        (d / "chars").write_text(str(n))
    # the new code re-hashes a file changed within 2 s of hashing it: let the files age
    age = time.time() - max(p.stat().st_ctime for p in d.iterdir())
    if age < 3:
        time.sleep(3 - age)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "CORPUS"), help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="50,500", help="millions of characters, comma-separated")
    ap.add_argument("--old-max", type=int, default=50,
                    help="run the old code only up to this size (millions of characters)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per cached-open figure")
    ap.add_argument("--data", default=os.environ.get("QKGEOM_DATA") or str(
        ROOT.parent / "shared" / "data" / "wikitext"))
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "qkgeom-bench" / "corpus"))
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    workdir = Path(args.workdir).expanduser()
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        corpus = build(size, Path(args.data), workdir)
        row: dict = {"size_M": size}
        for impl in ("old", "new") if size <= args.old_max else ("new",):
            cache = workdir / f"cache-{impl}-{size}M"
            shutil.rmtree(cache, ignore_errors=True)
            enc = measure(impl, corpus, cache)
            opens = [measure(impl, corpus, cache) for _ in range(args.repeats)]
            assert all(o["key"] == enc["key"] for o in opens)
            row[impl] = {"key": enc["key"], "train_chars": enc["n"],
                         "encode_s": round(enc["s"], 3),
                         "encode_extra_mib": round(enc["extra_mib"], 1),
                         "open_s": round(statistics.median(o["s"] for o in opens), 4),
                         "open_extra_mib": round(max(o["extra_mib"] for o in opens), 1)}
            print(json.dumps({"size_M": size, impl: row[impl]}), flush=True)
        if "old" in row:
            o, n = row["old"], row["new"]
            assert o["key"] == n["key"], "old and new keys differ"
            for s in ("train", "val", "test"):  # the same arrays, byte for byte
                pa, pb = (workdir / f"cache-{i}-{size}M" / "encoded" / o["key"] / f"{s}.npy"
                          for i in ("old", "new"))
                assert _digest(pa) == _digest(pb), f"{s}.npy differs"
            row["ratio_old_over_new"] = {
                k: round(o[k] / n[k], 1) for k in ("encode_s", "encode_extra_mib", "open_s",
                                                    "open_extra_mib") if n[k] > 0}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for cache in workdir.glob("cache-*"):
        shutil.rmtree(cache, ignore_errors=True)


def _digest(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        while b := fh.read(1 << 24):
            h.update(b)
    return h.hexdigest()


if __name__ == "__main__":
    main()
