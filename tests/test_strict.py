"""Strict inputs: where a person types a value, it is taken as typed or refused in one line naming the file or
flag, the field and the fix; exit 2; nothing written (a refused ``train`` creates no run directory).

Every CLI case runs ``shardkeeper.cli.main(argv)`` in-process and is refused before any rank starts; the flow
request cases go through the flows' own validation entry (no server).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shardkeeper.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
TINY_TEXT = TINY.read_text()


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {".": (root.stat().st_mtime_ns, 0)}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_size if p.is_file() else 0)
    return out


def edit(old: str, new: str, name: str = "x.yaml") -> Callable[[Path], str]:
    """configs/tiny.yaml with one edit, written into the workspace."""

    def make(ws: Path) -> str:
        assert old in TINY_TEXT, old
        (ws / name).write_text(TINY_TEXT.replace(old, new, 1))
        return str(ws / name)

    return make


def train(*extra: str, config: Callable[[Path], str] | None = None) -> Callable[[Path], list[str]]:
    return lambda ws: [
        "train",
        "--config",
        config(ws) if config else str(TINY),
        "--run-dir",
        str(ws / "new-run"),
        *extra,
    ]


def resume_with_duplicate(ws: Path) -> list[str]:
    """A run directory whose run.yaml (edited by hand) gives seed twice; train resumes from it (no --config)."""
    run = ws / "run"
    run.mkdir()
    (run / "run.yaml").write_text(TINY_TEXT.replace("seed: 1234\n", "seed: 1234\nseed: 7\n"))
    return ["train", "--run-dir", str(run)]


def export_folder(ws: Path) -> str:
    (ws / "export").mkdir()
    (ws / "export" / "config.json").write_text("{}")
    return str(ws / "export")


SEED_LINE = next(i for i, ln in enumerate(TINY_TEXT.splitlines(), 1) if ln.startswith("seed:"))
LR_LINE = next(i for i, ln in enumerate(TINY_TEXT.splitlines(), 1) if ln.strip().startswith("lr:"))

CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    # --- a key given twice: in a config file, in a run's run.yaml, in a --set value
    (
        "duplicate-key-config",
        train(config=edit("  lr: 3.0e-3\n", "  lr: 3.0e-3\n  lr: 1.0e-3\n", "dup.yaml")),
        f"dup.yaml line {LR_LINE + 1}: key optim.lr given twice; keep one",
    ),
    ("duplicate-key-run-yaml", resume_with_duplicate, f"run.yaml line {SEED_LINE + 1}: key seed given twice; keep one"),
    (
        "duplicate-key-set",
        train("--set", "model.config={vocab_size: 256, vocab_size: 300}"),
        "the value's line 1: key vocab_size given twice; keep one",
    ),
    # --- integers take whole numbers only
    (
        "int-from-true",
        train(config=edit("seed: 1234", "seed: true")),
        "x.yaml: field seed: expected a whole number, got True (a boolean); write a whole number",
    ),
    (
        "int-from-string",
        train(config=edit("global_batch_size: 12", 'global_batch_size: "12"')),
        "x.yaml: field global_batch_size: expected a whole number, got '12' (a string)",
    ),
    (
        "int-from-fraction",
        train(config=edit("interval: 5", "interval: 2.5")),
        "x.yaml: field checkpoint.interval: expected a whole number, got 2.5 (a decimal number)",
    ),
    (
        "int-from-whole-float",
        train(config=edit("global_batch_size: 12", "global_batch_size: 12.0")),
        "field global_batch_size: expected a whole number, got 12.0",
    ),
    ("int-from-true-set", train("--set", "seed=true"), "--set: field seed: expected a whole number, got True"),
    ("int-from-string-set", train("--set", "data.seq_len='32'"), "--set: field data.seq_len: expected a whole number"),
    (
        "literal-int-from-true",
        train("--set", "deepspeed.zero_stage=true"),
        "--set: deepspeed.zero_stage True: write 1, 2 or 3",
    ),
    # --- booleans take true/false only (YAML 1.2: yes/on are strings)
    (
        "bool-from-yes",
        train(config=edit("async_save: false", "async_save: yes")),
        "x.yaml: field checkpoint.async_save: expected true or false, got 'yes' (a string)",
    ),
    (
        "bool-from-one",
        train(config=edit("async_save: false", "async_save: 1")),
        "field checkpoint.async_save: expected true or false, got 1 (an integer)",
    ),
    (
        "bool-from-on-set",
        train("--set", "performance.compile=on"),
        "--set: field performance.compile: expected true or false",
    ),
    # --- numbers: strings refused (an int is a number)
    (
        "float-from-string",
        train(config=edit("lr: 3.0e-3", 'lr: "3.0e-3"')),
        "x.yaml: field optim.lr: expected a number, got '3.0e-3' (a string)",
    ),
    (
        "float-in-pair-from-string",
        train("--set", "optim.betas=[0.9, '0.95']"),
        "--set: field optim.betas.1: expected a number, got '0.95' (a string); "
        "write a number without quotes, e.g. betas:",
    ),
    (
        "string-from-number",
        train("--set", "name=123"),
        "--set: field name: expected a string, got 123 (an integer); quote it",
    ),
    # --- values that cannot train
    (
        "total-below-warmup",
        train(config=edit("total_steps: 200", "total_steps: 3")),
        "x.yaml: schedule.total_steps 3 is less than schedule.warmup_steps 5",
    ),
    (
        "vocab-size-one",
        train(config=edit("vocab_size: 256", "vocab_size: 1")),
        "x.yaml: model.config.vocab_size 1: must be a whole number of at least 2",
    ),
    (
        "vocab-size-true",
        train("--set", "model.config.vocab_size=true"),
        "--set: model.config.vocab_size True: must be a whole",
    ),
    (
        "until-step-absurd",
        train("--until-step", str(10**13)),
        "--until-step 10000000000000: more than 1,000,000,000,000 optimizer steps",
    ),
    ("until-step-beyond-int64", train("--until-step", str(2**64)), f"--until-step {2**64}: more than"),
    ("schedule-beyond-max", train("--set", f"schedule.total_steps={10**13}"), "--set: field schedule.total_steps"),
    # --- control characters in paths
    (
        "control-config",
        lambda ws: ["train", "--config", str(TINY) + "\n", "--run-dir", str(ws / "new-run")],
        "--config '" + str(TINY) + "\\n': contains control characters ('\\n'); use a plain path",
    ),
    (
        "control-run-dir",
        lambda ws: ["train", "--config", str(TINY), "--run-dir", str(ws / "new\nrun")],
        "--run-dir '" + "WS/new\\nrun': contains control characters ('\\n')",
    ),
    (
        "control-script",
        lambda ws: ["train", "--script", "tr\tain.py", "--run-dir", str(ws / "new-run")],
        "--script 'tr\\tain.py': contains control characters ('\\t')",
    ),
    (
        "control-data-path",
        train(config=edit("  source: synthetic\n", '  source: tokens\n  path: "/t\\nx.bin"\n')),
        "x.yaml: data.path '/t\\nx.bin': contains control characters ('\\n'); use a plain path",
    ),
    (
        "control-dataset",
        train(config=edit("  source: synthetic\n", '  source: dataset\n  dataset: "d\\x1b.jsonl"\n')),
        "x.yaml: data.dataset 'd\\x1b.jsonl': contains control characters ('\\x1b')",
    ),
    (
        "control-pretrained-set",
        train("--set", 'model.pretrained="m\\rx"'),
        "--set: model.pretrained 'm\\rx': contains control characters ('\\r')",
    ),
    ("control-export-out", lambda ws: ["export", str(ws / "ck"), str(ws / "out\n")], "OUT_DIR '"),
    (
        "control-export-tokenizer",
        lambda ws: ["export", str(ws / "ck"), str(ws / "out"), "--tokenizer-from", "t\x7f"],
        "--tokenizer-from 't\\x7f': contains control characters ('\\x7f')",
    ),
    ("control-publish-dir", lambda ws: ["publish", export_folder(ws) + "\n", "--target", "file:///x"], "EXPORT_DIR '"),
    (
        "control-publish-target",
        lambda ws: ["publish", export_folder(ws), "--target", "file:///x\n"],
        "--target 'file:///x\\n': contains control characters",
    ),
]


@pytest.mark.parametrize("argv,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_typed_input_is_taken_as_typed_or_refused(
    argv: Callable[[Path], list[str]],
    fragment: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.chdir(ws)
    args = argv(ws)
    before = snapshot(ws)
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert fragment.replace("WS", str(ws)) in lines[0], lines[0]
    assert snapshot(ws) == before, "the refused command wrote into the workspace"
    assert not (ws / "new-run").exists()


# ------------------------------------------------------------------------------------- what still works
def test_set_values_keep_their_yaml_types() -> None:
    """--set reads values by YAML rules: 7 is an int, 1e-3 a float, an int a float field takes, true a boolean."""
    from shardkeeper.config import load_run_spec

    spec = load_run_spec(
        TINY,
        [
            "seed=7",
            "optim.lr=1e-3",
            "optim.weight_decay=0",
            "checkpoint.async_save=true",
            "optim.betas=[0.9, 1e-1]",
            "deepspeed.zero_stage=3",
            "name='123'",
        ],
    )
    assert spec.seed == 7 and type(spec.seed) is int
    assert spec.optim.lr == 1e-3 and spec.optim.weight_decay == 0.0 and type(spec.optim.weight_decay) is float
    assert spec.checkpoint.async_save is True and spec.optim.betas == (0.9, 0.1) and spec.deepspeed.zero_stage == 3
    assert spec.name == "123"


def test_float_fields_take_integers_and_configs_in_use_load(tmp_path: Path) -> None:
    from schemas import RunSpec
    from shardkeeper.config import dump_run_spec, load_run_spec

    cfg = tmp_path / "c.yaml"
    cfg.write_text(TINY_TEXT.replace("lr: 3.0e-3", "lr: 1").replace("grad_clip: 1.0", "grad_clip: 2"))
    spec = load_run_spec(cfg)
    assert spec.optim.lr == 1.0 and spec.optim.grad_clip == 2.0
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        s = load_run_spec(path)
        # what a run writes to run.yaml (and a manifest records as JSON) reads back as the same spec
        (tmp_path / "run.yaml").write_text(dump_run_spec(s))
        assert load_run_spec(tmp_path / "run.yaml") == s
        assert RunSpec.model_validate_json(s.model_dump_json()) == s


REQUESTS: list[tuple[str, str, dict, str]] = [
    (
        "nproc-true",
        "train",
        {"segments": [{"nproc": True, "until_step": 4}]},
        "field segments.0.nproc: expected a whole number, got True",
    ),
    (
        "until-step-string",
        "train",
        {"segments": [{"nproc": 2, "until_step": "4"}]},
        "field segments.0.until_step: expected a whole number, got '4'",
    ),
    (
        "until-step-fraction",
        "train",
        {"segments": [{"nproc": 2, "until_step": 4.5}]},
        "field segments.0.until_step: expected a whole number",
    ),
    ("until-step-absurd", "train", {"segments": [{"nproc": 2, "until_step": 10**13}]}, "segments.0.until_step"),
    ("deep-validate-one", "train", {"deep_validate": 1}, "field deep_validate: expected true or false, got 1"),
    ("backoff-string", "train", {"backoff_s": "5"}, "field backoff_s: expected a number, got '5'"),
    (
        "inline-spec-seed-true",
        "train",
        {"config": None, "spec": {"seed": True}},
        "field spec.seed: expected a whole number",
    ),
    ("run-dir-control", "train", {"run_dir": "runs/a\nb"}, "run_dir 'runs/a\\nb': contains control characters"),
    ("export-dir-control", "train", {"export_dir": "e\tx"}, "export_dir 'e\\tx': contains control characters"),
    ("resume-nproc-string", "resume", {"roots": ["/data"], "nproc": "2"}, "field nproc: expected a whole number"),
    ("resume-root-control", "resume", {"roots": ["/da\nta"], "nproc": 2}, "roots[0] '/da\\nta': contains control"),
]


@pytest.mark.parametrize("model,raw,fragment", [r[1:] for r in REQUESTS], ids=[r[0] for r in REQUESTS])
def test_flow_requests_are_strict(model: str, raw: dict, fragment: str) -> None:
    from flows.common import RequestError, parse_request
    from schemas.requests import ResumeRequest, TrainExportRequest

    base = (
        {"config": str(TINY), "run_dir": "runs/a", "segments": [{"nproc": 2, "until_step": 4}]}
        if model == "train"
        else {}
    )
    cls = TrainExportRequest if model == "train" else ResumeRequest
    with pytest.raises(RequestError) as info:
        parse_request(cls, {**base, **raw})
    msg = str(info.value)
    assert "\n" not in msg and fragment in msg, msg


def test_flow_request_numbers_as_json_gives_them() -> None:
    """A deployment's JSON parameters (ints for counts, an int for a float, a list for segments) still parse."""
    from flows.common import parse_request
    from schemas.requests import TrainExportRequest

    req = parse_request(
        TrainExportRequest,
        {
            "config": str(TINY),
            "run_dir": "r",
            "backoff_s": 0,
            "segments": [{"nproc": 2, "until_step": 4, "timeout_s": 30}],
        },
    )
    assert req.backoff_s == 0.0 and req.segments[0].timeout_s == 30.0
