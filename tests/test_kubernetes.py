"""Kubernetes manifests without a cluster: rendered PyTorchJobs and JobSets validate against the vendored CRD
schemas (and a broken one does not), world size and rendezvous agree, the pods receive the SegmentLaunch the local
launcher hands its ranks, the pod entry's exit codes, the Prefect work-pool template, and `shardkeeper manifest`."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import yaml

from ckpt.commit.fsutil import load_yaml
from launch import get_launcher
from launch.base import LaunchRequest
from launch.k8s_pod import EXIT_POD_FAILED, EXIT_POD_PREEMPTED, fresh_report, install_run_spec, pod_exit_code
from launch.k8s_pod import run as pod_run
from launch.k8s_validate import ManifestInvalid, problems, validate
from launch.kubernetes import (
    KILL_MARGIN_S,
    LAUNCH_KEY,
    RDZV_PORT,
    SPEC_KEY,
    K8sOptions,
    ManifestError,
    render,
    render_validated,
    world_size_of,
)
from schemas import ClusterTopology, RunSpec
from schemas.errors import ShardkeeperError
from schemas.seam import REPORT_FILE, SegmentLaunch, SegmentReport
from shardkeeper.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
SPEC = RunSpec(global_batch_size=16)


def request(
    nodes: int, nproc: int = 2, device: str = "cpu", run_dir: str = "llama-ft", segment: int = 3
) -> LaunchRequest:
    topo = ClusterTopology(
        nodes=nodes,
        procs_per_node=nproc,
        device_type=device,  # type: ignore[arg-type]
        backend="nccl" if device == "cuda" else "gloo",
        launcher="kubernetes",
    )
    return LaunchRequest(run_dir=run_dir, until_step=100, segment=segment, topology=topo)  # type: ignore[arg-type]


def pod_specs(job: dict) -> list[dict]:
    if job["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    return [r["template"]["spec"]["template"]["spec"] for r in job["spec"]["replicatedJobs"]]


def arg(command: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in command if a.startswith(f"--{name}="))


@pytest.mark.parametrize("kind", ["pytorchjob", "jobset"])
@pytest.mark.parametrize("nodes", [1, 2, 4])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rendered_segment_validates_and_agrees_on_world_size(kind: str, nodes: int, device: str) -> None:
    config_map, job = render_validated(SPEC, request(nodes, 2, device), K8sOptions(kind=kind, grace_s=120))
    assert not problems(config_map) and not problems(job)
    name = job["metadata"]["name"]
    launch = SegmentLaunch.model_validate_json(config_map["data"][LAUNCH_KEY])
    assert RunSpec.model_validate(load_yaml(config_map["data"][SPEC_KEY])) == SPEC  # as the ranks read run.yaml
    assert world_size_of(job) == launch.topology.world_size == nodes * 2
    for pod in pod_specs(job):
        (container,) = pod["containers"]
        cmd = container["command"]
        assert cmd[:4] == ["python", "-m", "launch.k8s_pod", "--"] and "--standalone" not in cmd
        assert arg(cmd, "nnodes") == str(nodes) and arg(cmd, "nproc-per-node") == "2"
        assert arg(cmd, "rdzv-backend") == "c10d" and arg(cmd, "rdzv-id") == name
        assert arg(cmd, "node-rank") == ("$(PET_NODE_RANK)" if kind == "pytorchjob" else "$(JOB_COMPLETION_INDEX)")
        host = f"{name}-master-0" if kind == "pytorchjob" else f"{name}-node-0-0.{name}"
        assert arg(cmd, "rdzv-endpoint") == f"{host}:{RDZV_PORT}"
        assert cmd[-4:] == ["trainer.segment", "/runs/llama-ft", "100", "3"] and launch.run_dir == "/runs/llama-ft"
        assert arg(cmd, "shutdown-timeout") == "120" and pod["terminationGracePeriodSeconds"] == 120 + KILL_MARGIN_S
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["SHARDKEEPER_LAUNCH"] == "/etc/shardkeeper/segment-launch.json"
        assert {"mountPath": "/runs", "name": "runs"}.items() <= container["volumeMounts"][0].items()
        assert ("nvidia.com/gpu" in container["resources"]["limits"]) == (device == "cuda")
    if kind == "pytorchjob":
        replicas = job["spec"]["pytorchReplicaSpecs"]
        hosts = {
            role: arg(r["template"]["spec"]["containers"][0]["command"], "rdzv-conf") for role, r in replicas.items()
        }
        assert hosts == {"Master": "is_host=1", **({"Worker": "is_host=0"} if nodes > 1 else {})}
        assert replicas["Master"]["replicas"] == 1 and replicas.get("Worker", {"replicas": 0})["replicas"] == nodes - 1
        assert {r["restartPolicy"] for r in replicas.values()} == {"ExitCode"}  # 143 retried, 1 permanent
        assert job["spec"]["nprocPerNode"] == "2"
    else:
        rjob = job["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert rjob["parallelism"] == rjob["completions"] == nodes and rjob["completionMode"] == "Indexed"
        rule = rjob["podFailurePolicy"]["rules"][0]
        assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [EXIT_POD_PREEMPTED]


def test_pods_receive_what_the_local_launcher_hands_its_ranks(tmp_path: Path) -> None:
    from launch.local import LocalTorchrun

    run_dir = tmp_path / "runs" / "llama-ft"
    run_dir.mkdir(parents=True)
    req = request(2, 2, "cuda", run_dir=str(run_dir), segment=5)
    env = LocalTorchrun().environment(req)
    local = SegmentLaunch.read(env["SHARDKEEPER_LAUNCH"])
    config_map, _ = render_validated(SPEC, req, K8sOptions())
    pods = SegmentLaunch.model_validate_json(config_map["data"][LAUNCH_KEY])
    # The same launch, except the watchdog pid (the pods' lifetime is their container's) and the launch time (a
    # manifest is rendered long before a pod starts: the ranks time their phases from their own start).
    assert pods == local.model_copy(update={"launcher_pid": None, "launched_at": None})
    assert local.launched_at is not None
    assert local.launcher_pid is not None


def test_the_validator_refuses_broken_manifests() -> None:
    _, job = render(SPEC, request(2), K8sOptions())
    broken = copy.deepcopy(job)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "1"
    found = problems(broken)
    assert any(p.startswith("spec.pytorchReplicaSpecs.Worker.replicas:") and "integer" in p for p in found), found
    with pytest.raises(ManifestInvalid, match="replicas"):
        validate(broken)
    typo = copy.deepcopy(job)
    typo["spec"]["pytorchReplicaSpecs"]["Master"]["replica"] = 1  # strict fields: a misspelt key is refused
    assert any("replica" in p and "Additional properties" in p for p in problems(typo))
    dup = copy.deepcopy(job)
    env = dup["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    env.append(dict(env[0]))  # x-kubernetes-list-type: map, keyed by name
    assert any("same key" in p for p in problems(dup))
    quantity = copy.deepcopy(job)
    resources = quantity["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"]
    resources["requests"]["cpu"] = 4  # int-or-string: an integer quantity is as good as "4"
    assert not problems(quantity)
    resources["requests"]["cpu"] = 4.5  # but not a float
    assert any("requests.cpu" in p for p in problems(quantity))
    resources["requests"]["cpu"] = "4"
    resources["limits"]["memory"] = "8GB"  # not a Kubernetes quantity (8G or 8Gi)
    assert any("limits.memory" in p and "does not match" in p for p in problems(quantity))
    big = copy.deepcopy(job)
    big["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2**31  # format: int32
    assert any("out of range for int32" in p for p in problems(big))
    assert problems({"apiVersion": "batch/v2", "kind": "Job"})  # no schema is not "valid"


def test_rendering_refuses_bad_options() -> None:
    with pytest.raises(ManifestError, match="--kind tfjob: unknown kind"):
        render(SPEC, request(1), K8sOptions(kind="tfjob"))
    with pytest.raises(ManifestError, match="--grace-s 0"):
        render(SPEC, request(1), K8sOptions(grace_s=0))
    with pytest.raises(ManifestError, match="launcher 'local'"):
        local = request(1)
        render(
            SPEC,
            LaunchRequest(
                run_dir=local.run_dir,
                until_step=1,
                segment=0,
                topology=local.topology.model_copy(update={"launcher": "local"}),
            ),
            K8sOptions(),
        )
    long = render(SPEC, request(1, run_dir="/data/runs/" + "Very_Long.Run-Name" * 5, segment=12), K8sOptions())
    assert len(long[1]["metadata"]["name"]) <= 40 and long[1]["metadata"]["name"].endswith("-s12")


def test_kubernetes_launcher_is_registered_and_says_how_to_apply() -> None:
    launcher = get_launcher("kubernetes")
    assert launcher.max_world_size() is None
    for refuse in (lambda: launcher.launch(request(2), print), lambda: launcher.preflight(request(2).topology)):
        with pytest.raises(ShardkeeperError) as e:
            refuse()
        msg = str(e.value)
        assert "\n" not in msg and "shardkeeper manifest" in msg and "--nodes 2 --nproc 2" in msg
        assert "kubectl apply -f" in msg


def test_pod_exit_codes_follow_the_segment_report(tmp_path: Path) -> None:
    report = SegmentReport(
        segment=3, status="preempted", start_step=0, end_step=10, world_size=4, topology=request(2).topology
    )
    assert pod_exit_code(0, None, False) == 0
    assert pod_exit_code(1, report, False) == EXIT_POD_PREEMPTED == 143
    assert pod_exit_code(1, report.model_copy(update={"status": "completed"}), False) == EXIT_POD_FAILED
    assert pod_exit_code(1, None, True) == EXIT_POD_PREEMPTED  # stopped during start-up, before any report
    assert pod_exit_code(1, None, False) == EXIT_POD_FAILED
    launch = SegmentLaunch(run_dir=str(tmp_path), until_step=10, segment=3, topology=request(2).topology)
    report.write(tmp_path)  # an earlier attempt's report must not decide this attempt
    fail = [sys.executable, "-c", "raise SystemExit(1)"]
    assert pod_run(fail, launch, wait_s=0) == EXIT_POD_FAILED
    writes = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text(sys.argv[2]); raise SystemExit(1)"
    fresh = [sys.executable, "-c", writes, str(tmp_path / REPORT_FILE), report.model_dump_json()]
    assert pod_run(fresh, launch, wait_s=0) == EXIT_POD_PREEMPTED
    assert fresh_report(tmp_path, 4, None, 0) is None  # another segment's report


def test_pod_entry_installs_run_yaml_only_into_a_new_run(tmp_path: Path) -> None:
    source = tmp_path / "run.yaml.src"
    source.write_text("name: a\n")
    run = tmp_path / "runs" / "new"
    assert "installed" in install_run_spec(run, str(source)) and (run / "run.yaml").read_text() == "name: a\n"
    source.write_text("name: b\n")
    assert "keeps its own spec" in install_run_spec(run, str(source))
    assert (run / "run.yaml").read_text() == "name: a\n" and [p.name for p in run.iterdir()] == ["run.yaml"]


def test_work_pool_template_is_a_valid_prefect_kubernetes_template() -> None:
    import jsonschema

    from infra.k8s.work_pool import check, load_template, render_manifest

    template = load_template()
    jsonschema.Draft202012Validator.check_schema(template["variables"])
    assert check(template) == []
    job = render_manifest(template, {"name": "x", "command": "prefect flow-run execute"})
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "shardkeeper-flow-runner"
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "shardkeeper-runs"
    assert pod["containers"][0]["args"] == ["prefect", "flow-run", "execute"]
    undeclared = copy.deepcopy(template)
    undeclared["job_configuration"]["job_manifest"]["spec"]["activeDeadlineSeconds"] = "{{ deadline }}"
    assert any("undeclared" in p for p in check(undeclared))
    wrong = copy.deepcopy(template)
    wrong["variables"]["properties"]["backoff_limit"]["default"] = "none"  # a string where the Job needs an int
    found = check(wrong)
    assert any(p.startswith("variables default") for p in found) and any("backoffLimit" in p for p in found)
    renamed = copy.deepcopy(template)
    renamed["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["name"] = "main"
    assert any("containers/0/name" in p for p in check(renamed))
    rbac = list(yaml.safe_load_all((ROOT / "infra" / "k8s" / "flow-runner-rbac.yaml").read_text()))
    rules = {r for d in rbac if d["kind"] == "Role" for rule in d["rules"] for r in rule["resources"]}
    assert {"pytorchjobs", "jobsets", "configmaps"} <= rules


def test_cli_manifest_writes_validated_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "seg.yaml"
    argv = [
        "manifest",
        "--config",
        TINY,
        "--run-dir",
        "/data/runs/tiny",
        "--nodes",
        "2",
        "--nproc",
        "3",
        "--until-step",
        "40",
        "--kind",
        "jobset",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert re.search(r"JobSet tiny-[0-9a-f]{6}-s0", capsys.readouterr().err)
    config_map, job = yaml.safe_load_all(out.read_text())
    assert not problems(job) and world_size_of(job) == 6
    assert job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"][0] == {
        "name": "runs",
        "persistentVolumeClaim": {"claimName": "shardkeeper-runs"},
    }
    assert SegmentLaunch.model_validate_json(config_map["data"][LAUNCH_KEY]).run_dir == "/data/runs/tiny"
    assert main(argv[:-2]) == 0 and capsys.readouterr().out.startswith("apiVersion: v1\nkind: ConfigMap")


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--nodes", "0"], "--nodes 0: must be at least 1"),
        (["--nproc", "0"], "--nproc 0: must be at least 1"),
        (
            ["--nodes", "5"],
            "--nodes 5 --nproc 1: global_batch_size 12 is not divisible by 5 ranks; choose --nodes x --nproc",
        ),
        (["--nodes", "2", "--nproc", "4"], "not divisible by 8 ranks"),
        (["--kind", "mpijob"], "--kind mpijob: unknown kind; choose one of pytorchjob, jobset"),
        (["--device", "tpu"], "--device 'tpu': choose cuda or cpu"),
        (["--grace-s", "0"], "--grace-s 0"),
        (["--namespace", "Team_A"], "--namespace 'Team_A': not a valid Kubernetes name"),
        (["--image", "my image"], "--image 'my image'"),
        (["--until-step", "0"], "--until-step 0: must be at least 1"),
        (["--set", "optim.lrr=1"], "unknown key optim.lrr"),
    ],
)
def test_cli_manifest_bad_input_is_one_line(
    extra: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "seg.yaml"
    assert main(["manifest", "--config", TINY, "--run-dir", "tiny", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not out.exists()


def test_names_and_paths_from_user_text_stay_apart_and_literal() -> None:
    """Run directories whose names fold to one DNS label get different job names; a '$(' in a path is not
    expanded by the kubelet."""
    from launch.base import LaunchRequest
    from launch.kubernetes import K8sOptions, job_name, torchrun_command
    from schemas import ClusterTopology

    topo = ClusterTopology(nodes=2, procs_per_node=1, launcher="kubernetes")
    a, b = (
        LaunchRequest(run_dir=Path(d), until_step=4, segment=0, topology=topo) for d in ("/r/Bad_Name", "/r/bad-name")
    )
    opts = K8sOptions(image="img:1")
    assert job_name(a, opts) != job_name(b, opts)
    odd = LaunchRequest(run_dir=Path("/data/x$(MASTER_ADDR)y"), until_step=4, segment=0, topology=topo)
    cmd = torchrun_command(odd, "h:29400", "id", 60, "$(PET_NODE_RANK)", "1")
    assert "/data/x$$(MASTER_ADDR)y" in cmd and "--node-rank=$(PET_NODE_RANK)" in cmd


def test_cli_manifest_of_a_users_script_carries_it_in_run_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--script without --config: the pods' run.yaml names the script (a path inside the image, kept as given) and
    its arguments after --; the world size is the script's business (no batch divisibility check)."""
    out = tmp_path / "seg.yaml"
    assert (
        main(
            [
                "manifest",
                "--script",
                "/app/train.py",
                "--run-dir",
                "own",
                "--nodes",
                "3",
                "--nproc",
                "1",
                "--device",
                "cpu",
                "--out",
                str(out),
                "--",
                "--lr",
                "1e-3",
            ]
        )
        == 0
    )
    config_map, job = yaml.safe_load_all(out.read_text())
    spec = yaml.safe_load(config_map["data"]["run.yaml"])
    assert spec["script"] == {"path": "/app/train.py", "args": ["--lr", "1e-3"]} and world_size_of(job) == 3
    assert main(["manifest", "--run-dir", "own", "--out", str(out)]) == 2
    assert "--config or --script" in capsys.readouterr().err
