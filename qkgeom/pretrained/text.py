"""The text a pretrained probe reads: where it comes from, its tokens, its sequences.

:func:`text_windows` cuts token ids into model-sized sequences with the tokenizer's own
affixes (not :func:`qkgeom.engine.data.windows`, which cuts training batches at given starts);
:func:`batches` pads them into ``(input_ids, attention_mask)`` chunks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkgeom.errors import QkgeomError
from qkgeom.pretrained.base import PretrainedError


def default_text() -> Path:
    """The WikiText test text: ``$QKGEOM_DATA/wiki.test.raw``, the cache, or a download."""
    from qkgeom.engine import data

    cands = []
    env = os.environ.get("QKGEOM_DATA")
    if env:
        cands.append(Path(env) / "wiki.test.raw" if Path(env).is_dir() else Path(env))
    cands += [data.cache_dir() / n / "wiki.test.raw" for n in ("wikitext-103", "wikitext-2")]
    for c in cands:
        if c.is_file():
            return c
    try:
        return data.download("wikitext-103") / "wiki.test.raw"
    except QkgeomError as e:
        raise PretrainedError(f"no default text: pass --text PATH (e.g. wiki.test.raw) or set "
                              f"QKGEOM_DATA to a WikiText directory. ({e})") from None


def read_text(path: str | Path | None) -> tuple[str, Path]:
    p = default_text() if path is None else Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise PretrainedError(f"cannot read --text {p}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise PretrainedError(f"--text {p} is not UTF-8 text") from None
    if not text.strip():
        raise PretrainedError(f"--text {p} is empty")
    return text, p


def tokenize_text(tokenizer: Any, text: str, max_tokens: int | None,
                  block_chars: int = 1 << 16) -> list[int]:
    """Token ids of ``text`` (no special tokens), tokenized in newline-aligned blocks."""
    ids: list[int] = []
    pos = 0
    while pos < len(text) and (max_tokens is None or len(ids) < max_tokens):
        end = min(len(text), pos + block_chars)
        if end < len(text):
            nl = text.rfind("\n", pos, end)
            end = nl + 1 if nl > pos else end
        ids += tokenizer(text[pos:end], add_special_tokens=False, verbose=False)["input_ids"]
        pos = end
    return ids if max_tokens is None else ids[:max_tokens]


def special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds around a text (e.g. ``[BOS]``, or ``[CLS]`` ... ``[SEP]``)."""
    bare = tokenizer("hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("hello", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return list(full[:i]), list(full[i + len(bare):])
    return [], []


def text_windows(ids: Sequence[int], seq_len: int, prefix: Sequence[int] = (),
            suffix: Sequence[int] = ()) -> list[list[int]]:
    """Split ``ids`` into sequences of at most ``seq_len`` tokens including the affixes."""
    body = seq_len - len(prefix) - len(suffix)
    if body < 1:
        raise PretrainedError(f"--seq-len {seq_len} leaves no room for text tokens")
    return [list(prefix) + list(ids[i:i + body]) + list(suffix)
            for i in range(0, len(ids), body)]


def batches(seqs: list[list[int]], batch_size: int, pad_id: int) -> Iterator[tuple[Tensor, Tensor]]:
    """``(input_ids, attention_mask)`` batches, right-padded to the longest sequence."""
    for i in range(0, len(seqs), batch_size):
        part = seqs[i:i + batch_size]
        t = max(len(s) for s in part)
        ids = torch.full((len(part), t), pad_id, dtype=torch.long)
        am = torch.zeros(len(part), t, dtype=torch.long)
        for j, s in enumerate(part):
            ids[j, :len(s)] = torch.tensor(s, dtype=torch.long)
            am[j, :len(s)] = 1
        yield ids, am
