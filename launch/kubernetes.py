"""Kubernetes: the ranks of one segment as a Kubeflow PyTorchJob (kubeflow.org/v1) or a JobSet
(jobset.x-k8s.io/v1alpha2), rendered here and applied with kubectl. There is no cluster where this was
written, so ``KubernetesLauncher.launch`` does not apply anything: ``shardkeeper manifest`` renders and
validates the manifests (``launch.k8s_validate``, against the vendored CRD schemas), ``kubectl apply -f``
submits them.

What a rendered segment is (one YAML stream, two objects):

- a **ConfigMap** ``<name>-launch`` holding ``segment-launch.json`` (the ``schemas.seam.SegmentLaunch`` of the
  segment, exactly what the local launcher writes to ``RUN_DIR/.segment-launch.json``, with no launcher pid)
  and ``run.yaml`` (the RunSpec), mounted read-only at ``/etc/shardkeeper``; ``SHARDKEEPER_LAUNCH`` names the
  file, as for local ranks. A ConfigMap rather than a file written into the run directory: the manifest is
  rendered where the run directory usually is not mounted (a laptop, a CI job), and the object that starts
  the ranks then carries everything they read, so a retried pod reads the same launch and ``kubectl get`` shows it;
- the **job**: ``nodes`` pods, each running ``python -m launch.k8s_pod -- torchrun ...`` (the command of
  ``launch.base.torchrun_argv``, as on Slurm) with ``--nnodes=N --nproc-per-node=P --rdzv-backend=c10d
  --rdzv-endpoint=<first pod>:29400`` and the node rank from the controller's environment, the run
  directory on a PersistentVolumeClaim (ReadWriteMany: every node writes its shards into the same
  checkpoint), ``/dev/shm`` in memory, cpu/memory requests per rank and ``nvidia.com/gpu: P`` on CUDA.
  (``$(PET_NODE_RANK)`` from Kubeflow, ``$(JOB_COMPLETION_INDEX)`` in a JobSet's indexed Job; c10d numbers
  the nodes as they join and only logs it: the data order depends only on the global rank, so any numbering
  resumes exactly).

Preemption. The kubelet sends SIGTERM and waits ``terminationGracePeriodSeconds`` (= ``grace_s`` +
``KILL_MARGIN_S``): the ranks agree at the next step boundary, commit a checkpoint and exit 75, and torchrun
gets ``--shutdown-timeout=grace_s`` before it kills them. torchrun itself exits 1 for any rank's non-zero
code, so the pod entry (``launch.k8s_pod``) turns the segment's report into the container's exit code:
0 completed, **143 preempted** (128 + SIGTERM, the code a pod the kubelet stopped ends with), 1 failed.
Kubeflow's ``restartPolicy: ExitCode`` treats 1-127 as permanent and 128-255 as retryable (its
``IsRetryableExitCode``), so a preempted pod is recreated and resumes from the checkpoint it committed,
while a failed one fails the job. In a JobSet the Job's ``podFailurePolicy`` fails the Job at once (reason
``PodFailurePolicy``) on any exit code but 143, the JobSet's ``failurePolicy`` rule turns that into a failed
JobSet, and every other Job failure (143, or a pod lost with its node) restarts the whole JobSet, at most
``max_restarts`` times. Kubeflow's ``runPolicy.backoffLimit`` counts container restarts, which ExitCode's
delete-and-recreate does not produce, so a PyTorchJob retries preemptions without bound.

A rank that dies while its pod lives (``checkpoint.restarts`` > 0, the run's own setting). Each pod's torchrun is
shardkeeper's agent with ``--max-restarts`` (``trainer.agent``): it restarts the ranks inside the pod, in place, from
the fork server in the same container, and they resume from the newest snapshot in the pod's ``/dev/shm`` (an
``emptyDir`` of medium Memory, which lives as long as the pod). The pod does not restart and the job controller sees
nothing; each restart is one ``shardkeeper-restart:`` line in the pod's log (``kubectl logs``). With several pods,
the ranks of the other pods fail on their lost peer and their agents restart them too, in the same rendezvous round.
What the agent does not restart (an error of the rank's own, or the restarts used up) ends torchrun with 1 and the
pod with 1 (failed), as before. A pod that is lost (its node gone, evicted) is not restarted in place: before any
restart every agent checks that the other pods' agents still beat in the rendezvous store (``trainer.agent``), so
the survivors of a lost pod do not restart and wait for it; their pods fail as before a node loss always did (apply
the manifest again; the lost node's files come from the peer node's memory). (Rendered and validated here; no
cluster ran them.)

Not done for a segment applied with kubectl (``shardkeeper train`` does it around a local launch): the run lock,
``segments.jsonl`` and the segment's lineage event, the sweep of abandoned ``.partial`` directories, and the
choice of the segment index (``--segment``).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

from launch.base import LaunchOutcome, LaunchRequest, LogSink, Rendezvous, torchrun_argv
from launch.k8s_pod import EXIT_POD_PREEMPTED, SPEC_ENV
from schemas import ClusterTopology, RunSpec
from schemas.errors import ConfigError
from schemas.seam import LAUNCH_ENV, SegmentLaunch

Kind = Literal["pytorchjob", "jobset"]
KINDS: tuple[str, ...] = ("pytorchjob", "jobset")
CONTAINER = "pytorch"  # Kubeflow's webhook requires a container of this name; JobSet pods use it too
RDZV_PORT = 29400
MASTER_PORT = 23456  # Kubeflow's default "pytorchjob-port" (MASTER_PORT); declared so the operator adds nothing
LAUNCH_MOUNT = "/etc/shardkeeper"
LAUNCH_KEY = "segment-launch.json"
SPEC_KEY = "run.yaml"
RUNS_MOUNT = "/runs"  # where the PVC is mounted when --run-dir is relative
KILL_MARGIN_S = 30  # the kubelet's SIGKILL comes this long after torchrun's own shutdown timeout
NAME_MAX = 40  # pods are <name>-worker-<i> / <name>-node-<j>-<i>: hostnames stay under 63 characters
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


class ManifestError(ConfigError):
    """Options that cannot make a valid manifest; the message names the option and the fix."""


@dataclass(frozen=True)
class K8sOptions:
    image: str = "shardkeeper:latest"  # an image with this project installed (and the torch build of the nodes)
    namespace: str = "default"
    pvc: str = "shardkeeper-runs"  # ReadWriteMany claim holding the run directory
    grace_s: int = 60  # time to commit a checkpoint after SIGTERM (torchrun's --shutdown-timeout)
    kind: str = "pytorchjob"
    name: str | None = None  # default: <run dir name>-s<segment>
    cpu_per_rank: int = 2
    memory_gib_per_rank: int = 8
    max_restarts: int = 10  # JobSet failurePolicy.maxRestarts (a PyTorchJob retries preemptions without bound)
    image_pull_policy: str = "IfNotPresent"
    service_account: str | None = None


def dns_name(text: str, limit: int = NAME_MAX) -> str:
    """A DNS-1035 label made from ``text`` (lowercase, [a-z0-9-], starts with a letter)."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not slug or not slug[0].isalpha():
        slug = f"sk-{slug}".rstrip("-")
    return slug[:limit].rstrip("-")


def pod_run_dir(run_dir: str) -> tuple[str, str]:
    """(run directory in the pods, where the PVC is mounted): a relative --run-dir lives under /runs;
    an absolute one is used as given, with the volume mounted at its parent."""
    path = PurePosixPath(run_dir)
    if not run_dir.strip() or ".." in path.parts:
        raise ManifestError(
            f"--run-dir {run_dir!r}: give the run directory as the pods see it, e.g. llama-ft "
            f"(under {RUNS_MOUNT}) or /data/runs/llama-ft, without '..'"
        )
    if not path.is_absolute():
        return str(PurePosixPath(RUNS_MOUNT) / path), RUNS_MOUNT
    if len(path.parts) < 3:
        raise ManifestError(
            f"--run-dir {run_dir}: the volume is mounted at the run directory's parent, which "
            "must not be /; use a path like /data/runs/NAME or a relative NAME (under /runs)"
        )
    return str(path), str(path.parent)


def check_options(req: LaunchRequest, opts: K8sOptions) -> None:
    """Refuse what would render an invalid or useless manifest, naming the flag and the fix."""
    topo = req.topology
    if opts.kind not in KINDS:
        raise ManifestError(f"--kind {opts.kind}: unknown kind; choose one of {', '.join(KINDS)}")
    if topo.launcher != "kubernetes":
        raise ManifestError(
            f"topology launcher {topo.launcher!r}: render Kubernetes manifests for a 'kubernetes' topology"
        )
    if opts.grace_s < 1:
        raise ManifestError(f"--grace-s {opts.grace_s}: must be at least 1 second (the time a checkpoint takes)")
    for flag, value in (("--namespace", opts.namespace), ("--pvc", opts.pvc)):
        if not _DNS1035.match(value) and not (flag == "--pvc" and re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", value)):
            raise ManifestError(f"{flag} {value!r}: not a valid Kubernetes name; use lowercase letters, digits and '-'")
    if opts.name is not None and (not _DNS1035.match(opts.name) or len(opts.name) > NAME_MAX):
        raise ManifestError(f"name {opts.name!r}: must be a DNS-1035 label of at most {NAME_MAX} characters")
    if not opts.image.strip() or any(c.isspace() for c in opts.image):
        raise ManifestError(f"--image {opts.image!r}: give an image reference such as registry/shardkeeper:0.1.0")
    if opts.cpu_per_rank < 1 or opts.memory_gib_per_rank < 1 or opts.max_restarts < 0:
        raise ManifestError("cpu_per_rank and memory_gib_per_rank must be at least 1, max_restarts at least 0")


def job_name(req: LaunchRequest, opts: K8sOptions) -> str:
    if opts.name:
        return opts.name
    # A short hash of the whole run directory: two runs whose names fold to the same DNS label (Bad_Name and
    # bad-name, or two long names cut at the same length) never get the same job name.
    digest = hashlib.sha256(str(req.run_dir).encode()).hexdigest()[:6]
    suffix = f"-{digest}-s{req.segment}"
    return dns_name(PurePosixPath(str(req.run_dir)).name, NAME_MAX - len(suffix)) + suffix


def segment_launch(req: LaunchRequest) -> SegmentLaunch:
    """What the pods' ranks receive: the request's SegmentLaunch, without a launcher pid (the pods' lifetime
    is the container's: nothing of a segment outlives its pod)."""
    return SegmentLaunch(
        run_dir=str(req.run_dir),
        until_step=req.until_step,
        segment=req.segment,
        topology=req.topology,
        restart=req.restart,
        launcher_pid=None,
        data=req.data,
    )


def torchrun_command(
    req: LaunchRequest,
    endpoint: str,
    rdzv_id: str,
    grace_s: int,
    node_rank: str,
    is_host: str | None,
    restarts: int = 0,
) -> list[str]:
    """The pod's command: the pod entry, then the torchrun command every launcher runs on a node
    (``launch.base.torchrun_argv``), with c10d rendezvous at ``endpoint``. ``node_rank`` is a variable the
    kubelet expands (``$(PET_NODE_RANK)``); c10d numbers the nodes itself and only logs it. ``is_host=None``:
    one template for every pod (JobSet), so the flag is left out and c10d hosts the store on the pod whose
    address the endpoint resolves to (each pod has its own)."""
    rdzv = Rendezvous(endpoint, rdzv_id, node_rank=node_rank, is_host=is_host or "0")
    argv = torchrun_argv(
        "python", req.topology, grace_s, str(req.run_dir), req.until_step, req.segment, rdzv, restarts=restarts
    )
    if is_host is None:
        argv = [a for a in argv if not a.startswith("--rdzv-conf=is_host=")]
    # The kubelet expands $(VAR) in a container's command: a '$(' in the run directory is escaped as '$$('.
    argv = [a.replace("$(", "$$(") if str(req.run_dir) in a else a for a in argv]
    return ["python", "-m", "launch.k8s_pod", "--", *argv]


def _labels(req: LaunchRequest, name: str) -> dict[str, str]:
    run = dns_name(PurePosixPath(str(req.run_dir)).name, 63)
    return {
        "app.kubernetes.io/name": "shardkeeper",
        "app.kubernetes.io/component": "segment",
        "shardkeeper/run": run,
        "shardkeeper/segment": str(req.segment),
        "shardkeeper/job": name,
    }


def _pod_template(
    req: LaunchRequest,
    opts: K8sOptions,
    command: list[str],
    labels: dict[str, str],
    mount: str,
    ports: list[dict[str, Any]],
    cm_name: str,
) -> dict[str, Any]:
    topo = req.topology
    p = topo.procs_per_node
    resources: dict[str, Any] = {
        "requests": {"cpu": str(p * opts.cpu_per_rank), "memory": f"{p * opts.memory_gib_per_rank}Gi"},
        "limits": {"memory": f"{p * opts.memory_gib_per_rank}Gi"},
    }
    if topo.device_type == "cuda":
        resources["limits"]["nvidia.com/gpu"] = p
    container = {
        "name": CONTAINER,
        "image": opts.image,
        "imagePullPolicy": opts.image_pull_policy,
        "command": command,
        "env": [
            {"name": LAUNCH_ENV, "value": f"{LAUNCH_MOUNT}/{LAUNCH_KEY}"},
            {"name": SPEC_ENV, "value": f"{LAUNCH_MOUNT}/{SPEC_KEY}"},
            {"name": "OMP_NUM_THREADS", "value": "1"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "ports": ports,
        "resources": resources,
        "volumeMounts": [
            {"name": "runs", "mountPath": mount},
            {"name": "launch", "mountPath": LAUNCH_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": opts.grace_s + KILL_MARGIN_S,
        "containers": [container],
        "volumes": [
            {"name": "runs", "persistentVolumeClaim": {"claimName": opts.pvc}},
            {"name": "launch", "configMap": {"name": cm_name}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if opts.service_account:
        spec["serviceAccountName"] = opts.service_account
    return {"metadata": {"labels": dict(labels)}, "spec": spec}


def render(spec: RunSpec, req: LaunchRequest, opts: K8sOptions) -> list[dict[str, Any]]:
    """The ConfigMap and the job of one segment (not validated: see ``render_validated``)."""
    check_options(req, opts)
    run_dir, mount = pod_run_dir(str(req.run_dir))
    req = LaunchRequest(
        run_dir=run_dir,
        until_step=req.until_step,
        segment=req.segment,  # type: ignore[arg-type]
        topology=req.topology,
        restart=req.restart,
    )
    name = job_name(req, opts)
    labels = _labels(req, name)
    cm_name = f"{name}-launch"
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": cm_name, "namespace": opts.namespace, "labels": dict(labels)},
        "data": {
            LAUNCH_KEY: segment_launch(req).model_dump_json(indent=2) + "\n",
            # JSON (a subset of YAML): every string stays a string for the ranks' YAML 1.2 loader ("1e-2")
            SPEC_KEY: json.dumps(spec.model_dump(mode="json"), indent=2) + "\n",
        },
    }
    job = (_pytorchjob if opts.kind == "pytorchjob" else _jobset)(
        req, opts, name, labels, mount, cm_name, spec.checkpoint.restarts
    )
    return [config_map, job]


def _pytorchjob(
    req: LaunchRequest, opts: K8sOptions, name: str, labels: dict[str, str], mount: str, cm_name: str, restarts: int = 0
) -> dict[str, Any]:
    topo = req.topology
    endpoint = f"{name}-master-0:{RDZV_PORT}"  # the operator's headless Service of the Master pod
    ports = [
        {"name": "pytorchjob-port", "containerPort": MASTER_PORT, "protocol": "TCP"},
        {"name": "c10d", "containerPort": RDZV_PORT, "protocol": "TCP"},
    ]
    replicas = {}
    for role, count, is_host in (("Master", 1, "1"), ("Worker", topo.nodes - 1, "0")):
        if count:
            command = torchrun_command(req, endpoint, name, opts.grace_s, "$(PET_NODE_RANK)", is_host, restarts)
            replicas[role] = {
                "replicas": count,
                "restartPolicy": "ExitCode",
                "template": _pod_template(req, opts, command, labels, mount, ports, cm_name),
            }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": opts.namespace, "labels": dict(labels)},
        "spec": {
            "nprocPerNode": str(topo.procs_per_node),
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas,
        },
    }


def _jobset(
    req: LaunchRequest, opts: K8sOptions, name: str, labels: dict[str, str], mount: str, cm_name: str, restarts: int = 0
) -> dict[str, Any]:
    nodes = req.topology.nodes
    # Pod hostnames of a JobSet: <jobset>-<replicatedJob>-<job index>-<pod index>, under the subdomain <jobset>.
    endpoint = f"{name}-node-0-0.{name}:{RDZV_PORT}"
    ports = [{"name": "c10d", "containerPort": RDZV_PORT, "protocol": "TCP"}]
    command = torchrun_command(req, endpoint, name, opts.grace_s, "$(JOB_COMPLETION_INDEX)", None, restarts)
    pod = _pod_template(req, opts, command, labels, mount, ports, cm_name)
    pod["spec"]["restartPolicy"] = "Never"  # required by podFailurePolicy; restarts are the JobSet's
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": opts.namespace, "labels": dict(labels)},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "failurePolicy": {
                "maxRestarts": opts.max_restarts,
                "rules": [
                    {"name": "failed-segment", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
                ],
            },
            "replicatedJobs": [
                {
                    "name": "node",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": nodes,
                            "completions": nodes,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "podFailurePolicy": {
                                "rules": [
                                    {
                                        "action": "FailJob",
                                        "onExitCodes": {
                                            "containerName": CONTAINER,
                                            "operator": "NotIn",
                                            "values": [EXIT_POD_PREEMPTED],
                                        },
                                    }
                                ]
                            },
                            "template": pod,
                        }
                    },
                }
            ],
        },
    }


def render_validated(spec: RunSpec, req: LaunchRequest, opts: K8sOptions) -> list[dict[str, Any]]:
    """``render``, then every object checked against its vendored schema (raises k8s_validate.ManifestInvalid)."""
    from launch.k8s_validate import validate_all

    docs = render(spec, req, opts)
    validate_all(docs)
    return docs


def to_yaml(docs: list[dict[str, Any]]) -> str:
    """A YAML stream for kubectl; multi-line strings (the ConfigMap's files) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)


def world_size_of(job: dict[str, Any]) -> int:
    """nodes x procs per node, read back from a rendered job (for checks and tests)."""
    if job["kind"] == "PyTorchJob":
        nodes = sum(r["replicas"] for r in job["spec"]["pytorchReplicaSpecs"].values())
        return nodes * int(job["spec"]["nprocPerNode"])
    rjob = job["spec"]["replicatedJobs"][0]
    command = rjob["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    nproc = int(next(a for a in command if a.startswith("--nproc-per-node=")).split("=", 1)[1])
    return rjob["replicas"] * rjob["template"]["spec"]["parallelism"] * nproc


class KubernetesLauncher:
    """Registered as ``kubernetes`` in ``launch.LAUNCHERS``. It does not submit anything itself: render the
    segment with ``shardkeeper manifest`` and apply it with kubectl (see the module doc)."""

    name = "kubernetes"

    def max_world_size(self) -> int | None:
        return None  # the cluster's, unknown here

    def preflight(self, topology: ClusterTopology) -> None:
        """``shardkeeper train --launcher kubernetes`` is refused here, before the run directory is touched."""
        raise ManifestError(_how_to_apply("--config CONFIG --run-dir RUN_DIR", topology, "UNTIL"))

    def launch(self, req: LaunchRequest, sink: LogSink) -> LaunchOutcome:
        raise ManifestError(
            _how_to_apply(f"--config CONFIG --run-dir {req.run_dir}", req.topology, str(req.until_step))
        )


def _how_to_apply(args: str, topology: ClusterTopology, until: str) -> str:
    kubectl = "kubectl is on PATH, but this launcher does not submit" if shutil.which("kubectl") else "no kubectl here"
    return (
        f"--launcher kubernetes: ranks are not started from this process ({kubectl}); render the segment with "
        f"`shardkeeper manifest {args} --nodes {topology.nodes} --nproc {topology.procs_per_node} "
        f"--until-step {until} --out segment.yaml` and apply it with `kubectl apply -f segment.yaml`"
    )


def describe(docs: list[dict[str, Any]]) -> str:
    """One line: what was rendered (for the CLI)."""
    job = docs[-1]
    launch = json.loads(docs[0]["data"][LAUNCH_KEY])
    return (
        f"{job['kind']} {job['metadata']['name']} in namespace {job['metadata']['namespace']}: "
        f"{world_size_of(job)} ranks, steps until {launch['until_step']}, segment {launch['segment']}, "
        f"run directory {launch['run_dir']}"
    )
