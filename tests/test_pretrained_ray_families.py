"""Families of tiny random transformers models fanned out over a real local Ray instance.

Each supported attention family (GPT-2, GPT-NeoX, Llama, Qwen3, BERT; the models of
tests/test_pretrained_families.py) is saved at two seeds, with a real byte-level tokenizer
(built offline with ``tokenizers``; BOS for Llama, CLS/SEP for BERT), into a temporary
Hugging Face cache laid out as a download leaves it: ``models--qkgeom-test--tiny-FAMILY/
snapshots/SHA/`` plus ``refs/step1`` and ``refs/step2`` naming the two snapshots. So
``probe-pretrained --model qkgeom-test/tiny-FAMILY --revisions step1,step2 --ray`` runs
offline through the path a Pythia family takes. (A family of local directories has no CLI
form: ``--model DIR`` holds one revision, and one revision runs in-process, not on Ray.)

Ray workers inherit ``HF_HUB_CACHE`` from the driver that starts the instance. One local
instance serves the module (``run_on_ray`` uses a running one and leaves it running);
tests/test_pretrained_ray.py covers the CLI starting and stopping its own.

Checked: every revision stored with its step and the values an in-process measurement of
its snapshot directory gives (rel 1e-9), the two seeds differing; a second run skipping
both; a transient failure (``$QKGEOM_TEST_FAIL_REVISION``: the revision's first Ray task
raises) retried and then stored, and with ``--retries 0`` reported as FAILED.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ci_env import require
from helpers import run

transformers = require("transformers")  # an error under CI, a skip elsewhere
tokenizers = require("tokenizers")

from qkgeom import pretrained as P  # noqa: E402
from qkgeom.pretrained.ray_probe import FAULT_ENV  # noqa: E402

FAMILIES = ("gpt2", "neox", "llama", "qwen3", "bert")
SEEDS = {"step1": 1, "step2": 2}
SPECIALS = ["<pad>", "<bos>", "<cls>", "<sep>"]
AFFIXES = {"llama": (["<bos>"], []), "bert": (["<cls>"], ["<sep>"])}
D, L = 64, 2
MAX_TOKENS = "256"


def repo_id(family: str) -> str:
    return f"qkgeom-test/tiny-{family}"


def _tokenizer(family: str):  # type: ignore[no-untyped-def]
    """A byte-level tokenizer (no merges: one token per UTF-8 byte) with the family's
    special tokens around each sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {s: i for i, s in enumerate(SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    pre, suf = AFFIXES.get(family, ([], []))
    tk.post_processor = processors.TemplateProcessing(
        single=" ".join([*pre, "$A", *suf]), special_tokens=[(s, vocab[s]) for s in SPECIALS])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>",
                                               bos_token="<bos>")
    return tok, len(vocab)


def _model(family: str, vocab: int):  # type: ignore[no-untyped-def]
    t = transformers
    common = dict(vocab_size=vocab, max_position_embeddings=128)
    if family == "gpt2":
        return t.GPT2Model(t.GPT2Config(n_embd=D, n_layer=L, n_head=4, n_positions=128,
                                        vocab_size=vocab, bos_token_id=1, eos_token_id=1))
    if family == "neox":
        return t.GPTNeoXModel(t.GPTNeoXConfig(
            hidden_size=D, num_attention_heads=4, num_hidden_layers=L, intermediate_size=128,
            rotary_pct=0.25, **common))
    if family == "llama":
        return t.LlamaModel(t.LlamaConfig(
            hidden_size=D, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=L,
            intermediate_size=128, **common))
    if family == "qwen3":
        return t.Qwen3Model(t.Qwen3Config(
            hidden_size=D, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            num_hidden_layers=L, intermediate_size=128, **common))
    return t.BertModel(t.BertConfig(hidden_size=D, num_attention_heads=4, num_hidden_layers=L,
                                    intermediate_size=128, **common))


def _build_cache(hub: Path) -> dict[tuple[str, str], Path]:
    """Every family at both seeds as Hub revisions in the cache ``hub``; the snapshots."""
    snaps = {}
    for family in FAMILIES:
        tok, vocab = _tokenizer(family)
        repo = hub / f"models--{repo_id(family).replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        for rev, seed in SEEDS.items():
            torch.manual_seed(seed)
            sha = hashlib.sha1(f"{family}-{seed}".encode()).hexdigest()
            snap = repo / "snapshots" / sha
            _model(family, vocab).save_pretrained(snap)
            tok.save_pretrained(snap)
            (repo / "refs" / rev).write_text(sha)
            snaps[family, rev] = snap
    return snaps


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Path]]:
    """The cache's snapshots, with ``HF_HUB_CACHE`` naming it and a local Ray instance
    (2 CPUs) started after that, so its workers find the models offline."""
    from qkgeom.sweeps.ray_session import init_ray, shutdown

    root = tmp_path_factory.mktemp("hf")
    snaps = _build_cache(root / "hub")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(root / "hub"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.delenv(FAULT_ENV, raising=False)
        init_ray(num_cpus=2)
        try:
            yield snaps
        finally:
            shutdown()


@pytest.fixture(scope="module")
def text(wikitext_dir: Path) -> str:
    return str(wikitext_dir / "wiki.test.raw")


_REF: dict[tuple[str, str], dict] = {}


def reference(snap: Path, text: str) -> dict:
    """Metric values measured here, in this process, from the snapshot directory itself."""
    if snap not in _REF:
        job = P.RevisionJob("ref", None, "transformers", model_id=str(snap))
        body = Path(text).read_text(encoding="utf-8")
        rows = P.measure_job(job, body, text, max_tokens=int(MAX_TOKENS)).rows
        _REF[snap] = {(la, h, n): v for la, h, n, v in rows}
    return _REF[snap]


def stored(db: str, model: str) -> dict[str, dict]:
    """{revision: {"id", "step", "model_type", "values": {(layer, head, metric): value}}}."""
    from qkgeom.store import open_store

    with open_store(db) as store:
        runs = store.sql("SELECT id, revision, step, meta FROM pretrained_runs "
                         "WHERE model = :m", {"m": model})
        rows = store.sql("SELECT r.revision AS revision, m.layer AS layer, m.head_key AS hk, "
                         "m.metric AS metric, m.value AS value FROM pretrained_metrics m "
                         "JOIN pretrained_runs r ON r.id = m.run_id WHERE r.model = :m",
                         {"m": model})
    out: dict[str, dict] = {}
    for rid, rev, step, meta in runs.iter_rows():
        meta = json.loads(meta) if isinstance(meta, str) else meta
        out[rev] = {"id": rid, "step": step, "model_type": meta["model_type"], "values": {}}
    for rev, la, hk, me, v in rows.iter_rows():
        out[rev]["values"][(la, None if hk == -1 else hk, me)] = v
    return out


def assert_same(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def probe(family: str, db: str, text: str, *extra: str) -> tuple[int, str]:
    return run("probe-pretrained", "--model", repo_id(family), "--revisions", "step1,step2",
               "--ray", "--db", db, "--text", text, "--max-tokens", MAX_TOKENS, *extra)


MODEL_TYPE = {"gpt2": "gpt2", "neox": "gpt_neox", "llama": "llama", "qwen3": "qwen3",
              "bert": "bert"}


def test_each_family_as_hub_revisions_over_ray_stored_then_skipped(
        hub: dict, text: str, tmp_path: Path):
    db = "sqlite:///" + str(tmp_path / "fam.db")
    for family in FAMILIES:
        code, out = probe(family, db, text)
        assert code == 0, out
        assert "2 revision(s) as Ray tasks" in out and "stored as run" in out, out
        got = stored(db, repo_id(family))
        assert {r: (g["step"], g["model_type"]) for r, g in got.items()} == {
            "step1": (1, MODEL_TYPE[family]), "step2": (2, MODEL_TYPE[family])}
        for rev in SEEDS:
            assert_same(got[rev]["values"], reference(hub[family, rev], text))
        # two seeds, two models: a mix-up of revisions would make these equal
        w1, w2 = (got[r]["values"][(0, None, "pr_wq")] for r in SEEDS)
        assert w1 != pytest.approx(w2, rel=1e-6), family

    # a second run measures nothing and leaves every stored revision as it was
    for family in FAMILIES:
        before = {r: g["id"] for r, g in stored(db, repo_id(family)).items()}
        code, out = probe(family, db, text)
        assert code == 0, out
        assert "2 revision(s) already stored, skipped" in out and "Ray tasks" not in out
        assert {r: g["id"] for r, g in stored(db, repo_id(family)).items()} == before


def test_transient_failure_is_retried_then_stored(
        hub: dict, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    db = "sqlite:///" + str(tmp_path / "retry.db")
    monkeypatch.setenv(FAULT_ENV, "step2")  # step2's first attempt raises in its Ray task

    code, out = probe("qwen3", db, text, "--retries", "1")
    assert code == 0, out
    assert (f"step2: attempt 1 failed (InjectedFailure: {FAULT_ENV}: injected failure of "
            "step2, attempt 1 of the first 1); retrying") in out
    assert "FAILED" not in out and "step1: attempt" not in out
    got = stored(db, repo_id("qwen3"))
    assert set(got) == {"step1", "step2"}
    for rev in SEEDS:
        assert_same(got[rev]["values"], reference(hub["qwen3", rev], text))

    # without retries the same failure is final: reported by name, the other one stored
    code, out = probe("gpt2", db, text, "--retries", "0")
    assert code == 1, out
    assert "retrying" not in out
    assert "step2: FAILED after 1 attempt(s): InjectedFailure" in out
    assert "1 of 2 revision(s) failed" in out and "the other 1 are stored" in out
    got = stored(db, repo_id("gpt2"))
    assert set(got) == {"step1"}
    assert_same(got["step1"]["values"], reference(hub["gpt2", "step1"], text))
