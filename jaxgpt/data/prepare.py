"""``jaxgpt prepare``: documents -> token files (train.bin / val.bin + meta.json), streaming.

Sources: text files or globs (a document per file, per paragraph or per line), ``.jsonl`` and
``.parquet`` with a named text field, and a Hugging Face ``datasets`` dataset saved with
``save_to_disk`` (``datasets`` / ``pyarrow`` are optional, needed only for those). Each document
is encoded and followed by the EOS id. The work is cut into shards (a group of text files, a byte
range of a large text file (text_ranges.py) or of a jsonl file, a parquet file, a range of dataset
rows) that worker processes encode independently
(``num_proc``), each into ``OUT/.shards/NNNNN.{train,val}.bin`` plus a ``.done`` marker, in
chunks (memory bounded by one chunk and one document). A rerun skips shards with a marker.
Finally the shards are concatenated, in order, into ``train.bin`` and ``val.bin`` and removed
(``merge=False`` keeps them and lists them in meta.json instead: no second copy on disk).

Which documents are held out depends only on (shard, index in the shard), through a fixed hash
(``is_val``: a fraction f = val_fraction of them, on average), so the split, like the bytes, does
not depend on ``num_proc``. A small corpus can hold out no document at all (one text file is one
document): when the held-out documents have fewer than ``min_val_tokens`` tokens, the end of the
training stream makes up the difference (at most a tenth of the corpus), so ``jaxgpt train --data OUT``
finds a usable val.bin with default flags; ``val_fraction=0`` holds out nothing.

Character tokenizer: a first pass collects the characters; the EOS is ``'\\x00'`` (it must not
occur in the text), so the vocabulary is ``sorted(chars | {'\\x00'})`` and EOS has id 0. nanoGPT's
``meta.pkl`` is written too.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from jaxgpt.data import text_ranges
from jaxgpt.data.tokenfiles import dtype_for, write_meta, write_nanogpt_meta

CHAR_EOS = "\x00"
TEXT_UNITS = ("file", "paragraph", "line")
FILES_PER_SHARD = 64
ROWS_PER_SHARD = 50_000
JSONL_SHARD_BYTES = 64 << 20
CHUNK_TOKENS = 1 << 20  # tokens buffered per split before a write
# The validation tokens prepare guarantees by default: 8 windows of GPT-2's 1024-token context.
MIN_VAL_TOKENS = 8192


# --- Sources: shard plan and the documents of one shard ------------------------------------

def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and any((p / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _load_dataset(path: str, split: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path} is a saved `datasets` dataset: pip install 'jaxgpt[prepare]'") from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path} has splits {sorted(ds)}, not {split!r} (--split)")
        ds = ds[split]
    return ds


def plan_shards(sources: list[str], *, split: str = "train", text_unit: str = "file", tokenizer: str = "char",
                shard_bytes: int | None = None, log=None) -> list[dict]:
    """The shards of ``sources`` (paths or globs), in a fixed order. A text file over ``shard_bytes``
    is cut into byte ranges (text_ranges.py) where its documents allow it; ``log`` says why not.
    ``shard_bytes`` None: text_ranges.SHARD_BYTES."""
    shard_bytes = shard_bytes or text_ranges.SHARD_BYTES
    paths: list[str] = []
    for s in sources:
        hits = sorted(glob.glob(s)) if any(c in s for c in "*?[") else [s]
        if not hits:
            raise FileNotFoundError(f"no file matches {s!r}")
        paths += hits
    shards, texts = [], []
    for path in paths:
        p = Path(path)
        if _is_saved_dataset(p):
            n = len(_load_dataset(path, split))
            shards += [{"kind": "datasets", "path": path, "start": a, "stop": min(a + ROWS_PER_SHARD, n)}
                       for a in range(0, n, ROWS_PER_SHARD)]
        elif not p.is_file():
            raise FileNotFoundError(f"no file or saved dataset at {path!r}")
        elif p.suffix == ".jsonl":  # byte ranges, cut at line starts when read: one big file still spreads over workers
            size = p.stat().st_size
            shards += [{"kind": "jsonl", "path": path, "start": a, "stop": min(a + JSONL_SHARD_BYTES, size)}
                       for a in range(0, max(size, 1), JSONL_SHARD_BYTES)]
        elif p.suffix == ".parquet":
            shards.append({"kind": "parquet", "path": path})
        elif p.stat().st_size <= shard_bytes:
            texts.append(path)
        elif text_ranges.splittable(text_unit, tokenizer):
            shards += text_ranges.plan(path, text_unit, shard_bytes)
        else:
            if log is not None:
                log(f"{path}: one worker reads it whole, as one document (--text-unit file): a subword tokenizer "
                    "could merge tokens across a cut; --text-unit line or paragraph spreads it over --num-proc")
            texts.append(path)
    shards += [{"kind": "text", "paths": texts[i:i + FILES_PER_SHARD]} for i in range(0, len(texts), FILES_PER_SHARD)]
    if not shards:
        raise ValueError(f"no documents in {sources}")
    return shards


def _text_documents(text: str, text_unit: str) -> Iterator[str]:
    """The documents of a text: itself ('file'), or its non-blank paragraphs or lines."""
    if text_unit == "file":
        yield text
    else:
        parts = text.split("\n\n") if text_unit == "paragraph" else text.splitlines()
        yield from (t for t in parts if t.strip())


def documents(shard: dict, *, text_field: str = "text", text_unit: str = "file", split: str = "train") -> Iterator[str]:
    """The documents of one shard, in order."""
    kind = shard["kind"]
    if kind == "text_range":  # a piece of a large text file, from one cut to the next (text_ranges.py)
        yield from _text_documents(text_ranges.read(shard, text_unit), text_unit)
    elif kind == "text":
        for path in shard["paths"]:
            yield from _text_documents(Path(path).read_text(encoding="utf-8"), text_unit)
    elif kind == "jsonl":  # the lines that start in [start, stop)
        with open(shard["path"], "rb") as f:
            start, stop = shard.get("start", 0), shard.get("stop", float("inf"))
            if start > 0:
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()  # a line begun before start belongs to the shard before
            while f.tell() < stop:
                at, line = f.tell(), f.readline()
                if not line:
                    break
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                    raise ValueError(f"{shard['path']} (the line at byte {at}): no string field {text_field!r} "
                                     "(--text-field)")
                yield row[text_field]
    elif kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{shard['path']}: reading parquet needs pyarrow: pip install 'jaxgpt[prepare]'") from None
        f = pq.ParquetFile(shard["path"])
        if text_field not in f.schema_arrow.names:
            raise ValueError(f"{shard['path']} has columns {f.schema_arrow.names}, not {text_field!r} (--text-field)")
        for batch in f.iter_batches(columns=[text_field], batch_size=1024):
            yield from batch.column(0).to_pylist()
    else:
        ds = _load_dataset(shard["path"], split)
        if text_field not in ds.column_names:
            raise ValueError(f"{shard['path']} has columns {ds.column_names}, not {text_field!r} (--text-field)")
        for a in range(shard["start"], shard["stop"], 1024):
            yield from ds[a:min(a + 1024, shard["stop"])][text_field]


# --- Tokenizers -------------------------------------------------------------------------------

def load_tokenizer(spec: str, shards: list[dict], opts: dict, eos: str | None = None):
    """(tokenizer, eos_id, eos_token) for ``spec``: 'char' (built from the documents), an HF
    directory holding tokenizer.json, or a tokenizer.json file."""
    from jaxgpt.data.tokenizers import CharTokenizer

    if spec == "char":
        chars: set[str] = set()
        for shard in shards:
            for doc in documents(shard, **opts):
                chars.update(doc)
        if CHAR_EOS in chars:
            raise ValueError("the text contains '\\x00', the character tokenizer's document separator")
        return CharTokenizer(sorted(chars | {CHAR_EOS})), 0, CHAR_EOS
    from jaxgpt.data.hf_tokenizer import HFTokenizer

    p = Path(spec)
    if p.is_dir():
        tok = HFTokenizer.from_dir(p)
    elif p.is_file():
        tok = HFTokenizer(p.read_text(encoding="utf-8"))
    else:
        raise FileNotFoundError(f"--tokenizer {spec!r}: not 'char', an HF directory or a tokenizer.json file")
    if eos is not None:
        eos_id = tok._tok.token_to_id(eos)
        if eos_id is None:
            raise ValueError(f"--eos {eos!r} is not a token of {spec}")
    elif tok.eos_id is not None:
        eos_id = tok.eos_id
    else:
        eos_id = tok._tok.token_to_id("<|endoftext|>")  # GPT-2's separator, the usual one
        if eos_id is None:
            raise ValueError(f"{spec} names no EOS token (config.json eos_token_id, or <|endoftext|>): pass --eos TOKEN")
    tok.specials.setdefault("eos_token_id", [int(eos_id)])  # saved with the data: sampling stops at a document's end
    return tok, int(eos_id), tok._tok.id_to_token(eos_id)


# --- One shard --------------------------------------------------------------------------------

def is_val(shard: int, j: int, f: float) -> bool:
    """Document j of shard ``shard`` is held out: a fixed hash of (shard, j) below f, so the split
    depends on neither num_proc nor the shard sizes (a shard of 64 text files still holds out its
    share on average, corpus-wide)."""
    h = ((shard * 0x9E3779B1 + j) * 0x85EBCA77 + 0x165667B1) % (1 << 32)
    h = ((h ^ (h >> 15)) * 0xC2B2AE3D) % (1 << 32)
    return (h ^ (h >> 13)) / (1 << 32) < f


def encode_shard(i: int, shard: dict, work: Path, tok_dict: dict, eos_id: int, dtype: str, val_fraction: float,
                 opts: dict) -> dict:
    """Encode shard ``i`` into work/NNNNN.{train,val}.bin (skipped when its .done marker exists);
    returns the marker's counts."""
    done = work / f"{i:05d}.done"
    if done.is_file():
        return {**json.loads(done.read_text()), "skipped": True}
    from jaxgpt.data.tokenizers import tokenizer_from_dict

    tok = tokenizer_from_dict(tok_dict)
    counts = {"train": [0, 0], "val": [0, 0]}  # [documents, tokens]
    files = {s: open(work / f"{i:05d}.{s}.bin.tmp", "wb") for s in counts}
    bufs: dict[str, list] = {s: [] for s in counts}
    sizes = {s: 0 for s in counts}

    def flush(s: str) -> None:
        if bufs[s]:
            np.concatenate(bufs[s]).astype(dtype).tofile(files[s])
            bufs[s], sizes[s] = [], 0

    batch: list[str] = []

    def encode(docs: list[str], j0: int) -> None:
        if hasattr(tok, "_tok"):  # tokenizers' batch encoding (Rust, parallel inside a process)
            ids_list = [e.ids for e in tok._tok.encode_batch(docs)]
        else:
            ids_list = [tok.encode(d) for d in docs]
        for j, ids in enumerate(ids_list, j0):
            s = "val" if val_fraction and is_val(i, j, val_fraction) else "train"
            # a piece of a whole-file document that goes on in the next range has no EOS
            arr = np.append(np.asarray(ids, np.int64), [eos_id] if shard.get("eos", True) else [])
            bufs[s].append(arr)
            sizes[s] += len(arr)
            counts[s][0] += int(shard.get("eos", True))  # a document counts where it ends
            counts[s][1] += len(arr)
            if sizes[s] >= CHUNK_TOKENS:
                flush(s)

    j = 0
    for doc in documents(shard, **opts):
        batch.append(doc)
        if len(batch) == 256:
            encode(batch, j)
            j, batch = j + len(batch), []
    if batch:
        encode(batch, j)
    for s, f in files.items():
        flush(s)
        f.close()
        (work / f"{i:05d}.{s}.bin.tmp").replace(work / f"{i:05d}.{s}.bin")
    result = {"documents": {s: c[0] for s, c in counts.items()}, "tokens": {s: c[1] for s, c in counts.items()}}
    done.write_text(json.dumps(result))  # last: a shard without it is redone
    return result


def _val_top_up(tokens: dict, val_fraction: float, min_val_tokens: int) -> int:
    """How many training tokens to move to val.bin: what the held-out documents lack of
    min(min_val_tokens, a tenth of all tokens); 0 without a validation split."""
    if not val_fraction:
        return 0
    want = min(min_val_tokens, (tokens["train"] + tokens["val"]) // 10)
    return max(0, want - tokens["val"])


def _move_tail(train: Path, val: Path, nbytes: int) -> None:
    """Move the last ``nbytes`` of ``train`` to the end of ``val``. The shards are still on disk until
    the run ends, so an interrupted move is redone from them by a rerun."""
    with open(train, "r+b") as f:
        f.seek(-nbytes, os.SEEK_END)
        data = f.read()
        f.truncate(f.tell() - nbytes)
    with open(val, "ab") as f:
        f.write(data)


def _encode_star(args):
    return encode_shard(*args)


# --- The whole run ----------------------------------------------------------------------------

def _check_settings(text_unit: str, val_fraction: float, num_proc: int, min_val_tokens: int) -> None:
    if text_unit not in TEXT_UNITS:
        raise ValueError(f"text_unit must be one of {TEXT_UNITS}, got {text_unit!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc!r}")
    if min_val_tokens < 0:
        raise ValueError(f"min_val_tokens must be >= 0, got {min_val_tokens!r}")


def _encode_all(jobs: list[tuple], num_proc: int, progress: bool) -> dict[int, dict]:
    """{shard index: ``encode_shard``'s result} for every job, on ``num_proc`` processes, with a progress bar."""
    from tqdm.auto import tqdm

    t0, results = time.perf_counter(), {}
    bar = tqdm(total=len(jobs), unit="shard", disable=not progress, dynamic_ncols=True)
    n_tok = 0
    if num_proc == 1:
        it = map(_encode_star, jobs)
        pool = None
    else:
        import multiprocessing as mp

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # processes, not threads, do the parallel work
        pool = mp.get_context("spawn").Pool(num_proc)
        it = pool.imap(_encode_star, jobs)
    try:
        for i, r in enumerate(it):
            results[i] = r
            n_tok += sum(r["tokens"].values())
            bar.set_postfix_str(f"{n_tok / max(time.perf_counter() - t0, 1e-9) / 1e3:,.1f}k tok/s"
                                + (", skipped finished shards" if r.get("skipped") else ""), refresh=False)
            bar.update(1)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    return results


def _merge_shards(out: Path, files: dict[str, list[str]]) -> None:
    """``out/train.bin`` and ``out/val.bin``: each split's shard files concatenated in order."""
    for s in ("train", "val"):
        tmp = out / f"{s}.bin.tmp"
        with open(tmp, "wb") as dst:
            for name in files[s]:
                with open(out / name, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
        tmp.replace(out / f"{s}.bin")


def prepare(sources: list[str], out: str | Path, tokenizer: str = "char", *, text_field: str = "text",
            text_unit: str = "file", split: str = "train", val_fraction: float = 0.0005,
            min_val_tokens: int = MIN_VAL_TOKENS, num_proc: int = 1, eos: str | None = None, merge: bool = True,
            progress: bool = True, log=print) -> dict:
    """Tokenize ``sources`` into ``out``; returns the meta.json dict.

    ``val_fraction``: the fraction of documents held out for val.bin (0: none). ``min_val_tokens``: when
    the held-out documents have fewer tokens, val.bin is topped up with the last tokens of the training
    stream, up to min(min_val_tokens, a tenth of all tokens) (merged output only; 0: never)."""
    _check_settings(text_unit, val_fraction, num_proc, min_val_tokens)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / ".shards"
    work.mkdir(exist_ok=True)
    opts = {"text_field": text_field, "text_unit": text_unit, "split": split}
    shards = plan_shards(sources, split=split, text_unit=text_unit, tokenizer=tokenizer, log=log)
    tok, eos_id, eos_token = load_tokenizer(tokenizer, shards, opts, eos)
    dtype = dtype_for(tok.vocab_size)
    plan = {"shards": shards, "tokenizer": tokenizer, "val_fraction": val_fraction, "opts": opts, "eos_id": eos_id}
    plan_path = work / "plan.json"
    if plan_path.is_file() and json.loads(plan_path.read_text()) != plan:
        raise ValueError(f"{out} holds an unfinished prepare run with other sources or settings: remove {work} "
                         "or prepare into a new directory")
    plan_path.write_text(json.dumps(plan))
    jobs = [(i, s, work, tok.to_dict(), eos_id, dtype, val_fraction, opts) for i, s in enumerate(shards)]
    t0 = time.perf_counter()
    results = _encode_all(jobs, num_proc, progress)
    totals = {k: {s: sum(r[k][s] for r in results.values()) for s in ("train", "val")} for k in ("documents", "tokens")}
    files = {s: [f".shards/{i:05d}.{s}.bin" for i in range(len(jobs))] for s in ("train", "val")}
    if merge:
        _merge_shards(out, files)
    tail = _val_top_up(totals["tokens"], val_fraction, min_val_tokens) if merge else 0
    if tail:
        _move_tail(out / "train.bin", out / "val.bin", tail * np.dtype(dtype).itemsize)
        totals["tokens"] = {"train": totals["tokens"]["train"] - tail, "val": totals["tokens"]["val"] + tail}
    meta = {"format": "jaxgpt-tokens-1", "vocab_size": tok.vocab_size, "dtype": dtype, "tokenizer": tok.to_dict(),
            "eos_id": eos_id, "eos_token": eos_token, "documents": totals["documents"], "tokens": totals["tokens"],
            "sources": sources, "text_field": text_field, "text_unit": text_unit, "val_fraction": val_fraction,
            "val_tail_tokens": tail}  # the training stream's last tokens, moved to val.bin
    if not merge:
        meta["files"] = files
    write_meta(out, meta)
    if tokenizer == "char":
        write_nanogpt_meta(out, tok.chars)
    if merge:
        shutil.rmtree(work)
    if tail:
        log(f"{totals['documents']['val']} held-out documents gave fewer than --min-val-tokens {min_val_tokens}: "
            f"val.bin also holds the last {tail:,} tokens of the training stream")
    elif val_fraction and totals["tokens"]["val"] == 0:
        log(f"warning: no document was held out (val_fraction={val_fraction} of {totals['documents']['train']} "
            "documents): raise --val-fraction (or drop --keep-shards), or train with --set val_fraction=0")
    secs = time.perf_counter() - t0
    log(f"prepared {totals['documents']['train']:,} + {totals['documents']['val']:,} documents, "
        f"{totals['tokens']['train']:,} + {totals['tokens']['val']:,} tokens (train + val) as {dtype} in {out} "
        f"({secs:.1f} s, {sum(totals['tokens'].values()) / max(secs, 1e-9) / 1e3:,.1f}k tok/s)")
    return meta


__all__ = ["CHAR_EOS", "TEXT_UNITS", "documents", "encode_shard", "load_tokenizer", "plan_shards", "prepare"]
