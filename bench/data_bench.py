"""Tokenization throughput of ``prepare-data`` (trainer.builtin.prepare.prepare_split: datasets.map with num_proc, then
the memmap written) against a single-process ``tokenizer(batch)`` loop over the same rows, same tokenizer.

    .venv/bin/python bench/data_bench.py [--docs 8000] [--reps 3] [--num-proc 2]

Corpus: documents of 40 consecutive lines of the Python standard library's sources (real English docstrings
and code, deterministic), written once as jsonl. Tokenizer: byte-level BPE with a 32k vocabulary trained on
it with the ``tokenizers`` library (nothing is downloaded). Each measurement runs in a fresh subprocess and
times only the work inside it (not the interpreter start or imports); the variants alternate, rep after rep,
and the table shows median (min–max) seconds and tokens/s. Both include loading the tokenizer. The Arrow conversion of
the jsonl that ``datasets`` caches is done once before the reps, so prepare-data's figure is tokenization + writing the
token file (+ reading the Arrow rows), the loop's is reading the jsonl + tokenization + writing the file.

``prepare-data`` is also run with num_proc=1: the same code in one process (it calls the fast tokenizer's
backend ``encode_batch`` directly, skipping the BatchEncoding that ``tokenizer(batch)`` builds), which
separates what the worker processes gain from what the leaner call gains.

The single-process loop is run twice: with the fast tokenizer's own Rust thread pool (TOKENIZERS_PARALLELISM
unset: ``tokenizer(batch)`` encodes a batch on every core) and with it off (one core). ``datasets.map``'s
worker processes run with the thread pool off (the tokenizers library turns it off in forked children).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import fmt  # noqa: E402 - bench/ is on the path when run as a script


def make_corpus(folder: Path, docs: int) -> Path:
    lines: list[str] = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in f.parts or "site-packages" in f.parts:
            continue
        try:
            lines += f.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        if len(lines) >= docs * 40:
            break
    if len(lines) < docs * 40:
        raise SystemExit(
            f"--docs {docs}: the standard library has {len(lines)} lines, enough for {len(lines) // 40} "
            "documents; ask for fewer"
        )
    path = folder / "corpus" / "train.jsonl"
    path.parent.mkdir(parents=True)
    with open(path, "w", encoding="utf-8") as out:
        for d in range(docs):
            out.write(json.dumps({"text": "\n".join(lines[d * 40 : (d + 1) * 40])}) + "\n")
    return path


def make_tok(folder: Path, corpus: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()[:5000]]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=32000,
            special_tokens=["<unk>", "<s>", "</s>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        folder
    )
    return folder


# ------------------------------------------------------------------------------------------ one measurement
def run_prepare(corpus: str, tok: str, cache: str, num_proc: int) -> dict:
    os.environ["SHARDKEEPER_DATA_CACHE"] = cache
    import importlib

    for module in ("datasets", "transformers", "transformers.models.auto.tokenization_auto"):
        importlib.import_module(module)  # imports are not timed, in either variant

    from schemas import RunSpec
    from trainer.builtin.prepare import prepare_split

    spec = RunSpec.model_validate({"data": {"source": "dataset", "dataset": corpus, "tokenizer": tok}})
    t0 = time.perf_counter()
    prep = prepare_split(spec, "train", num_proc=num_proc, progress=False)
    return {"seconds": time.perf_counter() - t0, "tokens": prep.tokens, "rows": prep.rows}


def run_loop(corpus: str, tok: str, out: str) -> dict:
    import numpy as np
    from transformers import AutoTokenizer

    t0 = time.perf_counter()  # loading the tokenizer counts, as it does in prepare-data
    tokenizer = AutoTokenizer.from_pretrained(tok)
    eos = tokenizer.eos_token_id
    with open(Path(corpus) / "train.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    n = 0
    with open(out, "wb") as sink:
        for i in range(0, len(texts), 1000):
            ids = tokenizer(texts[i : i + 1000])["input_ids"]
            flat = np.fromiter((t for x in ids for t in (*x, eos)), dtype=np.uint16)
            sink.write(flat.tobytes())
            n += flat.size
    return {"seconds": time.perf_counter() - t0, "tokens": n, "rows": len(texts)}


def measure(kind: str, corpus: Path, tok: Path, work: Path, num_proc: int, rep: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TOKENIZERS_PARALLELISM", None)
    if kind == "loop-1thread":
        env["TOKENIZERS_PARALLELISM"] = "false"
    args = [str(corpus.parent), str(tok)]
    if kind.startswith("prepare"):
        args += [str(work / f"cache-{kind}-{rep}"), str(1 if kind == "prepare-1" else num_proc)]
    else:
        args += [str(work / f"loop-{kind}-{rep}.bin")]
    out = subprocess.run([sys.executable, __file__, "--one", kind, *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{kind} rep {rep} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=8000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        kind, *rest = a.one
        res = run_prepare(rest[0], rest[1], rest[2], int(rest[3])) if kind.startswith("prepare") else run_loop(*rest)
        print(json.dumps(res))
        return
    with tempfile.TemporaryDirectory(prefix="data-bench-") as tmp:
        work = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf-datasets")  # the bench's Arrow conversion, removed after
        corpus = make_corpus(work, a.docs)
        tok = make_tok(work / "tok", corpus)
        measure("prepare", corpus, tok, work, a.num_proc, -1)  # warm-up: datasets converts the jsonl to Arrow once
        load_before = os.getloadavg()[0]
        kinds = ["prepare", "prepare-1", "loop-threads", "loop-1thread"]
        results: dict[str, list[dict]] = {k: [] for k in kinds}
        for rep in range(a.reps):
            for k in kinds:
                results[k].append(measure(k, corpus, tok, work, a.num_proc, rep))
        tokens = {k: {r["tokens"] for r in v} for k, v in results.items()}
        assert len(set().union(*tokens.values())) == 1, f"the variants made different token counts: {tokens}"
        n_tok = results["prepare"][0]["tokens"]
        size_mb = corpus.stat().st_size / 1e6
        cpus = len(os.sched_getaffinity(0))
        head = (
            f"{a.docs} documents ({size_mb:.1f} MB jsonl, {n_tok:,} tokens), byte-level BPE 32k, {cpus} CPUs, "
            f"{a.reps} alternated reps, median (min–max); 1-min load average {load_before:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after (other processes on the machine)"
        )
        table = []
        base = statistics.median(r["seconds"] for r in results["loop-1thread"])
        names = {
            "prepare": f"`prepare-data` (datasets.map, num_proc={a.num_proc}) + memmap",
            "prepare-1": "`prepare-data` with num_proc=1 (same code, one process)",
            "loop-threads": "1 process `tokenizer(batch)` loop, tokenizers' thread pool on",
            "loop-1thread": "1 process `tokenizer(batch)` loop, TOKENIZERS_PARALLELISM=false",
        }
        for k in kinds:
            secs = [r["seconds"] for r in results[k]]
            rates = [n_tok / s for s in secs]
            table.append(
                [
                    names[k],
                    fmt(secs),
                    f"{statistics.median(rates) / 1e6:.2f} M ({min(rates) / 1e6:.2f}–{max(rates) / 1e6:.2f})",
                    f"{base / statistics.median(secs):.2f}x",
                ]
            )
        from benchlib import md_table, publish

        publish(
            "tokenization", head + ":\n\n" + md_table(["variant", "seconds", "tokens/s", "vs loop (1 thread)"], table)
        )


if __name__ == "__main__":
    main()
