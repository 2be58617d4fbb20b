"""Loading a transformers model and its tokenizer (Hub id or local files, GGUF included)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qkgeom.pretrained.base import PretrainedError


@dataclass
class Loaded:
    """A model ready to measure."""

    model: Any
    tokenizer: Any
    meta: dict[str, Any]


def is_local(model_id: str) -> bool:
    """Whether ``model_id`` names an existing local path (else a Hub id)."""
    return Path(model_id).expanduser().exists()


def load_hf(model_id: str, *, revision: str | None = None, gguf_file: str | None = None,
            dtype: str = "float32", device: str = "cpu") -> Loaded:
    """Load a transformers model (base model, no head) and its tokenizer.

    ``model_id``: a local directory or a Hub id (downloaded once into the Hugging Face cache
    at ``revision``, e.g. ``step3000`` for Pythia). ``gguf_file``: a GGUF file inside the
    directory (dequantized to ``dtype`` by transformers). Offline without a local copy, a
    :class:`PretrainedError` names ``--model PATH``.
    """
    try:
        import transformers
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        raise PretrainedError("probe-pretrained needs transformers: pip install "
                              "'qkgeom[hf]' (transformers, gguf, tokenizers, sentencepiece)") from None
    path = Path(model_id).expanduser()
    if gguf_file and Path(gguf_file).is_absolute():
        path, gguf_file = Path(gguf_file).parent, Path(gguf_file).name
    local = path.exists()
    if local and gguf_file and not (path / gguf_file).is_file():
        raise PretrainedError(f"--gguf-file {gguf_file} not found in {path}")
    src = str(path) if local else model_id
    kw: dict[str, Any] = {}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    if revision and not local:
        kw["revision"] = revision
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise PretrainedError(f"--dtype {dtype!r} is not a torch dtype (float32, bfloat16, ...)")
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
        model = AutoModel.from_pretrained(src, dtype=torch_dtype, attn_implementation="eager",
                                          **kw)
    except (OSError, ValueError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if local:
            raise PretrainedError(f"cannot load model from {path}: {first}") from None
        why = ("HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
               if offline else "not in the local cache and the Hub did not provide it")
        raise PretrainedError(
            f"cannot load {model_id!r}{f' at revision {revision}' if revision else ''}: {why} "
            f"({first}). Pass --model PATH to a local copy (a directory with config.json and "
            "weights, or a directory plus --gguf-file FILE), or run online to download it"
        ) from None
    model.to(device).eval()
    cfg = model.config
    meta = {
        "source": "transformers", "model_type": cfg.model_type,
        "transformers": transformers.__version__, "dtype": dtype, "gguf_file": gguf_file,
        "path": str(path) if local else None, "revision": revision,
        "max_positions": _max_positions(cfg, tok),
    }
    return Loaded(model, tok, meta)


def _max_positions(cfg: Any, tok: Any) -> int | None:
    for k in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return v
    v = getattr(tok, "model_max_length", None)
    return v if isinstance(v, int) and v < 10**7 else None
