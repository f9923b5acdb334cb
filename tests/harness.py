"""Shared test helpers (no test module imports another): a spawn harness that runs a function on N real gloo
ranks on CPU (like DCP's own tests), and tiny runs to compare step by step."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The ranks fork from one server process that imported torch, DCP, FSDP2 and the transformers model code once
# (multiprocessing's forkserver): a rank starts in a fraction of a second instead of re-importing ~3 s of modules,
# and still runs in its own process with its own gloo group, as under spawn. The server keeps the environment and
# working directory it started with, so each rank takes its caller's current ones first. Only third-party modules
# are preloaded: shardkeeper's own import fresh in each rank, as under spawn.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "transformers",
    "transformers.models.llama.modeling_llama",
)


# Read by those modules when they are imported (huggingface_hub's cache paths and offline mode, torch's and the
# thread pools' settings): when the caller's values differ from the server's, the server is replaced by one started
# with the caller's (its preload paid once), never silently kept.
_IMPORT_ENV = (
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TORCH_",
    "PYTORCH_",
    "CUDA_",
    "NCCL_",
    "GLOO_",
    "OMP_",
    "MKL_",
    "KMP_",
    "XDG_",
    "PYTHON",
)
_server_env: list[dict[str, str]] = []


# Read when used, not at import: a rank takes them from its caller's environment like the rest. DeepSpeed's import
# sets PYTORCH_NVML_BASED_CUDA_CHECK in the importing process (read by torch.cuda's device count).
_CALL_TIME_ENV = {"TORCH_EXTENSIONS_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"}


def _import_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_ENV) and k not in _CALL_TIME_ENV}


def _context() -> Any:
    env = _import_env()
    if _server_env and _server_env[0] != env:
        if mp.active_children():  # stopping the server would wait for them: a fresh interpreter for this call
            return mp.get_context("spawn")
        from multiprocessing import forkserver

        forkserver._forkserver._stop()  # type: ignore[attr-defined]  # the next process starts a new one
        _server_env.clear()
    if not _server_env:
        _server_env.append(env)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))  # read once, when the server starts (the first spawn)
    return ctx


class _CallerStdio:
    """The caller's file descriptors 1 and 2 at the spawn, sent to the rank with the process (a rank forked by the
    server would otherwise write to the server's, not to what the calling test captures)."""

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return (_attach_stdio, (DupFd(1), DupFd(2)))


def _attach_stdio(out: Any, err: Any) -> None:
    for fd, target in ((out.detach(), 1), (err.detach(), 2)):
        if fd != target:  # under spawn the rank inherits the caller's 1 and 2 as they are
            os.dup2(fd, target)
            os.close(fd)


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    args: tuple,
    queue: Any,
    device: str,
    env: dict[str, str],
    cwd: str,
    stdio: None,
    nodes: int = 1,
) -> None:
    del stdio  # attached while the arguments were unpickled
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    per = world // nodes
    if nodes > 1:
        os.environ["SHARDKEEPER_NODE_NAME"] = f"node{rank // per}"
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % per),
            "LOCAL_WORLD_SIZE": str(per),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SHARDKEEPER_DEVICE": device,
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(*args)))
    except BaseException as e:  # report, do not hang the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def spawn(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 300,
    on_start: Callable[[list[mp.Process]], None] | None = None,
    device: str = "cpu",
    nodes: int = 1,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` ranks; return the per-rank results, or raise with the first error. ``nodes``:
    the ranks split into that many emulated nodes (local ranks, node names ``node0``...), as torchrun's agents set."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(
            target=_entry, args=(fn, r, world, port, args, queue, device, env, cwd, _CallerStdio(), nodes), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    if on_start:
        on_start(procs)
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, kind, value = queue.get(timeout=timeout)
            if kind == "error":
                errors.append(f"rank {rank}: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]


# ---------------------------------------------------------------------------------------- tiny runs
def side_by_side(chains: list[list[tuple]], at_once: int) -> dict[str, object]:
    """Run the chains ``at_once`` at a time (threads: each item mostly waits on its launch), each chain's items in
    order; an item is ``(key, fn, *args)``: ``fn(*args)`` is kept under ``key``, or ``key`` None for a step between
    them. What an item raised is kept under its key (for ``outcome`` to raise in the test that reads it), and the
    rest of its chain is not run."""
    from concurrent.futures import ThreadPoolExecutor

    out: dict[str, object] = {}

    def run(chain: list[tuple]) -> None:
        failed: BaseException | None = None
        for key, fn, *args in chain:
            if failed is not None:  # what comes after a failed step is not run: its test says why
                result: object = RuntimeError(f"not run: an earlier step of its chain raised {failed!r}")
            else:
                try:
                    result = fn(*args)
                except Exception as e:  # a timeout, say: kept for the test that reads it
                    result = failed = e
            if key is not None:
                out[key] = result

    with ThreadPoolExecutor(at_once) as pool:
        for f in [pool.submit(run, chain) for chain in chains]:
            f.result()
    return out


def outcome(results: dict[str, Any], key: str) -> Any:
    """A result ``side_by_side`` kept; what its item raised is raised here, in the test that reads it."""
    r = results[key]
    if isinstance(r, BaseException):
        raise r
    return r


def tiny_spec(**overrides: object):
    """The tiny Llama of configs/tiny.yaml (keeping every checkpoint), with ``key=value`` overrides."""
    from shardkeeper.config import load_run_spec

    sets = [f"{k}={v}" for k, v in overrides.items()]
    return load_run_spec(ROOT / "configs" / "tiny.yaml", ["checkpoint.keep_last=100", *sets])


def new_run(path: Path, spec: Any) -> Path:
    from ckpt.commit.layout import RunDir
    from shardkeeper.stages import prepare_run_dir

    prepare_run_dir(RunDir.at(path), spec)
    return path


def metrics(run: Path) -> dict[int, dict]:
    """Last-written metrics per step (a resumed segment's values win)."""
    out: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


def copy_run_until(src: Path, dst: Path, step: int) -> Path:
    """A copy of a run as it was right after ``step``: later checkpoints and metrics removed."""
    shutil.copytree(src, dst)
    for ck in (dst / "checkpoints").iterdir():
        if int(ck.name[5:13]) > step:
            shutil.rmtree(ck)
    lines = [ln for ln in (dst / "metrics.jsonl").read_text().splitlines() if json.loads(ln)["step"] <= step]
    (dst / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return dst


def assert_bitwise(ref: dict[int, dict], got: dict[int, dict], steps: range) -> None:
    for s in steps:
        assert got[s]["loss"] == ref[s]["loss"], f"step {s}: loss {got[s]['loss']!r} != {ref[s]['loss']!r}"
        assert got[s]["grad_norm"] == ref[s]["grad_norm"], f"step {s}: grad_norm differs"


def max_rel(ref: dict[int, dict], got: dict[int, dict], steps: range, key: str = "loss") -> float:
    return max(abs(got[s][key] - ref[s][key]) / abs(ref[s][key]) for s in steps)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM a helper server the tests started, SIGKILL it if it has not exited after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def copy_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".lock"))
    return dest


def mark_preempted(run: Path, until_step: int) -> None:
    """Make a run look like its last segment was preempted before ``until_step`` (what the stage writes)."""
    mark_segment(run, until_step, "preempted", exit_code=75)


def mark_segment(run: Path, until_step: int, status: str | None, *, exit_code: int = 1) -> None:
    """Append one more segment to a run's segments.jsonl that ended with ``status`` before ``until_step``
    (``None``: it started and never ended, as after a killed launcher)."""
    last = [json.loads(x) for x in (run / "segments.jsonl").read_text().splitlines()][-1]
    seg, step = last["segment"] + 1, last["end_step"] if "end_step" in last else last["start_step"]
    with open(run / "segments.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "event": "start",
                    "segment": seg,
                    "until_step": until_step,
                    "start_step": step,
                    "world_size": 2,
                    "time": "2026-01-01T00:00:00Z",
                }
            )
            + "\n"
        )
        if status is not None:
            f.write(
                json.dumps(
                    {
                        "event": "end",
                        "segment": seg,
                        "status": status,
                        "exit_code": exit_code,
                        "start_step": step,
                        "end_step": step,
                        "run_dir": str(run),
                        "checkpoint": None,
                        "seconds": 1.0,
                        "failure": None,
                    }
                )
                + "\n"
            )


# A chat template in the common shape (role markers, an end-of-turn token, a generation prompt); the tokenizer's
# tokenizer_config.json carries it, as a downloaded model's does.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def make_tokenizer(
    folder: Path, corpus: list[str], vocab_size: int = 300, chat_template: str | None = CHAT_TEMPLATE
) -> Path:
    """A byte-level BPE tokenizer trained on ``corpus`` with the ``tokenizers`` library, saved with
    save_pretrained (tokenizer.json + tokenizer_config.json with the chat template): nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.save_pretrained(folder)
    if chat_template:  # in tokenizer_config.json, where most published models keep it
        cfg_path = Path(folder) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = chat_template
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return folder


WORDS = (
    "the cat sat on a mat while rain fell over quiet hills and the river ran past old stone walls toward "
    "the sea where boats rocked slowly under grey skies"
).split()


def make_text_rows(n: int, seed: int = 0, words: int = 40) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [
        {"id": i, "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words)))} for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# Headless Chromium as the browser tests drive it (Debian's chromium through Playwright; never `playwright install`).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str | None:
    """The system Chromium ($CHROMIUM, else `chromium` or `chromium-browser` on PATH), or None."""
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
