"""Token-level query/key geometry of pretrained transformers and of qkgeom's own checkpoints.

The same metrics as a qkgeom probe (:data:`qkgeom.records.METRICS`), measured on a fixed
text sample (default: the WikiText test text) and streamed over chunks of it, so the token
budget is bounded by time, not memory:

* ``pr_q`` / ``pr_k``: PR of the mean-centred query/key vectors, from a float64
  :class:`~qkgeom.engine.metrics.StreamingCovariance` per layer (heads concatenated; a head's value
  is the PR of its ``d_head x d_head`` diagonal block). Memory is ``O(n_layers d^2)``, flat
  in the number of tokens. For rotary models these are the vectors *after* the rotary
  embedding (the ones that meet in ``q k^T``); ``pr_q_prerot`` / ``pr_k_prerot`` hold the
  projections before it.
* ``entropy`` / ``entropy_norm``: softmax of ``q k^T * scale`` with the model's own mask
  (causal for decoders; bidirectional with the padding mask for encoders), recomputed from
  the captured ``q`` and ``k`` and averaged over every counted query row of every chunk.
* ``token_erank``: effective rank of each head's row-centred score matrix ``q k_c^T`` (keys
  centred over the sequence), mean over the first ``erank_seqs`` sequences; from the
  post-rotary ``q`` and ``k`` in factored form (:func:`qkgeom.engine.metrics.token_effective_rank`:
  a ``d_head x d_head`` SVD per head and sequence, no logits).
* ``pr_wq``, ``pr_wk``, ``qk_pr``, ``qk_erank``: weight spectra; the interaction spectrum of
  ``W_Q^h (W_K^h)^T`` in factored form (for rotary models: the position-0 interaction).

Grouped-query attention: each query head ``h`` pairs with key head ``h // (H / H_kv)``,
exactly as the model's ``repeat_kv`` does; per-head key metrics repeat the shared key head's
value. The layer-level ``pr_k`` of the expanded keys equals that of the ``H_kv`` distinct
heads (duplicating blocks scales every eigenvalue by ``H / H_kv``; PR is scale-free), so the
smaller covariance is accumulated.

Capture works through transformers' public ``AttentionInterface`` (:mod:`.capture`).

One module per job:

* :mod:`.accumulate`: streaming statistics (:class:`GeometryAccumulator`);
* :mod:`.text`: the text sample, its tokens and sequences (:func:`text_windows`);
* :mod:`.capture`: capturing q/k/attention from a transformers model (:func:`measure_hf`);
* :mod:`.load`: loading a transformers model (:func:`load_hf`);
* :mod:`.checkpoints`: qkgeom's own checkpoints (:func:`resolve_checkpoints`,
  :func:`measure_gpt`);
* :mod:`.runs`: families of revisions, measured and stored (:func:`probe_pretrained`,
  :func:`probe_checkpoints`);
* :mod:`.ray_probe`: the same families fanned out as Ray tasks.

Importing this package imports torch: the CLI imports it only inside the command.
"""

from __future__ import annotations

from qkgeom.pretrained.accumulate import (
    GeometryAccumulator,
    lapack_threads,
)
from qkgeom.pretrained.base import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_ERANK_SEQS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEQ_LEN,
    Measurement,
    PretrainedError,
    TokenProgress,
)
from qkgeom.pretrained.capture import (
    ATTN_IMPL,
    AttnSite,
    capturing,
    is_rotary,
    measure_hf,
    site_weight_rows,
    visible_from_mask,
)
from qkgeom.pretrained.checkpoints import (
    checkpoint_dirs,
    load_checkpoint,
    measure_gpt,
    resolve_checkpoints,
    revision_step,
)
from qkgeom.pretrained.load import (
    Loaded,
    is_local,
    load_hf,
)
from qkgeom.pretrained.ray_probe import (
    RayOptions,
    run_on_ray,
)
from qkgeom.pretrained.runs import (
    RevisionJob,
    Stored,
    measure_job,
    probe_checkpoints,
    probe_pretrained,
    run_jobs,
    stored_revisions,
)
from qkgeom.pretrained.text import (
    batches,
    default_text,
    read_text,
    special_affixes,
    text_windows,
    tokenize_text,
)

__all__ = [
    "ATTN_IMPL",
    "AttnSite",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_ERANK_SEQS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_SEQ_LEN",
    "GeometryAccumulator",
    "Loaded",
    "Measurement",
    "PretrainedError",
    "RayOptions",
    "RevisionJob",
    "Stored",
    "TokenProgress",
    "batches",
    "capturing",
    "checkpoint_dirs",
    "default_text",
    "is_local",
    "is_rotary",
    "lapack_threads",
    "load_checkpoint",
    "load_hf",
    "measure_gpt",
    "measure_hf",
    "measure_job",
    "probe_checkpoints",
    "probe_pretrained",
    "read_text",
    "resolve_checkpoints",
    "revision_step",
    "run_jobs",
    "run_on_ray",
    "site_weight_rows",
    "special_affixes",
    "stored_revisions",
    "text_windows",
    "tokenize_text",
    "visible_from_mask",
]
