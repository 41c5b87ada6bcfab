"""Reading Slurm's output and writing its jobs: pure functions, no Slurm needed."""

from __future__ import annotations

import math
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from datacenter_agent.slurm.cli import (
    Record,
    expand_hostlist,
    parse_duration_s,
    parse_exit_code,
    parse_fields,
    parse_index_list,
    parse_records,
)
from datacenter_agent.slurm.job import (
    batch_script,
    job_comment,
    job_devices,
    job_outcome,
    parse_comment,
    parse_test_only,
    resource_args,
)
from datacenter_agent.slurm.select import gres_options
from datacenter_agent.slurm.view import cluster_view, is_usable, parse_gres, queue_state
from federation.agent.config import GresModel, SlurmSettings
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.compat import load_table_files, node_labels, unmet

from .tasks import gpu_task

NODE = (
    "NodeName=gpu01 Arch=x86_64 CoresPerSocket=1  CPUAlloc=3 CPUEfctv=8 CPUTot=8 "
    "CPULoad=0.48 AvailableFeatures=ib,nvme ActiveFeatures=ib Gres=gpu:a100:2(S:0),gpu:v100:1 "
    "GresDrain=N/A GresUsed=gpu:a100:1(IDX:1),gpu:v100:0(IDX:N/A) NodeAddr=10.0.0.1 "
    "NodeHostName=gpu01 Version=22.05.8 OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC  RealMemory=16000 "
    "AllocMem=4000 FreeMem=23103 Sockets=8 Boards=1 State=MIXED ThreadsPerCore=1 Partitions=gpu "
    "CfgTRES=cpu=8,mem=16000M,billing=8 AllocTRES=cpu=3,mem=4000M"
)
DRAINED = (
    "NodeName=gpu02 Arch=x86_64 CPUAlloc=0 CPUEfctv=8 CPUTot=8 Gres=gpu:a100:4 "
    "GresUsed=gpu:a100:0(IDX:N/A) RealMemory=16000 AllocMem=0 State=IDLE+DRAIN "
    "Partitions=gpu,debug Reason=bad fan, replaced Monday [root@2026-11-21T10:00:00]"
)
OTHER_PARTITION = "NodeName=cpu01 CPUTot=64 RealMemory=256000 State=IDLE Partitions=cpu"
JOB = (
    "JobId=42 JobName=fed.j1.main.3 UserId=root(0) JobState=RUNNING Reason=None "
    "ExitCode=0:0 RunTime=00:00:01 TimeLimit=00:05:00 Partition=gpu NodeList=gpu[01-02] "
    "NumNodes=2 JOB_GRES=gpu:a100:3   Nodes=gpu01 CPU_IDs=0 Mem=100 GRES=gpu:a100:2(IDX:0,2) "
    "  Nodes=gpu02 CPU_IDs=0 Mem=100 GRES=gpu:a100:1(IDX:3) Command=/w/job.sh "
    "Comment=federation:dc-a:j1:main:3  StdOut=/w/slurm-42.out Power="
)


def record(line: str) -> Record:
    return parse_records(line)[0]


def test_fields_keep_values_with_spaces() -> None:
    """A drain reason with spaces and commas stays one value; later keys still parse."""
    fields = dict(parse_fields(DRAINED))
    assert fields["Reason"] == "bad fan, replaced Monday [root@2026-11-21T10:00:00]"
    assert fields["State"] == "IDLE+DRAIN"
    assert dict(parse_fields(NODE))["OS"] == "Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC"


def test_fields_do_not_split_inside_values() -> None:
    """``key=value`` pairs inside a value (TRES lists) are not taken for fields."""
    fields = dict(parse_fields(NODE))
    assert fields["CfgTRES"] == "cpu=8,mem=16000M,billing=8"
    assert "cpu" not in fields


def test_records_placeholders_read_empty() -> None:
    """Slurm's ``(null)`` and ``N/A`` placeholders read as empty values."""
    rec = parse_records(NODE + "\n\n" + DRAINED + "\n")
    assert len(rec) == 2
    assert rec[0].value("GresDrain") == ""
    assert rec[0].get("GresDrain") == "N/A"


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
        ("a1,b[1-2]x,c", ["a1", "b1x", "b2x", "c"]),
        ("(null)", []),
    ],
)
def test_hostlists_expand(expression: str, names: list[str]) -> None:
    """Host lists expand with their zero padding and suffixes kept."""
    assert expand_hostlist(expression) == names


def test_gres_with_index_lists() -> None:
    """GRES items split outside parentheses, so ``IDX:0,2`` keeps both indices."""
    assert parse_index_list("0-2,5") == [0, 1, 2, 5]
    entries = parse_gres("gpu:a100:2(IDX:0,2),gpu:1(IDX:3),shard:4")
    assert [(e.name, e.type, e.count, e.indices) for e in entries] == [
        ("gpu", "a100", 2, (0, 2)),
        ("gpu", "", 1, (3,)),
        ("shard", "", 4, ()),
    ]


@pytest.mark.parametrize(
    ("state", "usable"),
    [
        ("IDLE", True),
        ("MIXED", True),
        ("ALLOCATED+COMPLETING", True),
        ("IDLE+DRAIN", False),
        ("MIXED+DRAIN", False),
        ("DOWN*", False),
        ("IDLE+NOT_RESPONDING", False),
        ("IDLE+POWERED_DOWN", False),
    ],
)
def test_node_states(state: str, usable: bool) -> None:
    """Drained, down and unresponsive nodes are not usable; busy ones are."""
    assert is_usable(state) is usable


def test_cluster_view_from_scontrol() -> None:
    """The partition's usable nodes carry Slurm's CPUs, memory, GPUs and allocations."""
    records = parse_records("\n".join([NODE, DRAINED, OTHER_PARTITION]))
    models = {"a100": GresModel(model="A100-80GB", memory_mib=81920)}
    view = cluster_view(records, "gpu", models)
    assert [n.name for n in view.nodes] == ["gpu01"]
    assert view.hidden == {"gpu02": "IDLE+DRAIN: " + dict(parse_fields(DRAINED))["Reason"]}
    node = view.nodes[0]
    assert (node.cpu_cores, node.memory_mib, node.arch) == (8, 16000, "x86_64")
    assert node.labels["slurm_features"] == "ib,nvme"
    assert [(d.index, d.model, d.vendor, d.memory_total_mib) for d in node.devices] == [
        (0, "A100-80GB", "nvidia", 81920),
        (1, "A100-80GB", "nvidia", 81920),
        (2, "v100", "nvidia", 0),
    ]
    assert view.usage.cpu["gpu01"] == 3
    assert view.usage.memory_mib["gpu01"] == 4000
    assert view.usage.devices == {("gpu01", 1)}


def test_queue_counts_partition_jobs_and_waits() -> None:
    """The queue counts the partition's jobs and waits for the latest expected start."""
    jobs = parse_records(
        "JobId=1 JobState=PENDING Partition=gpu\n"
        "JobId=2 JobState=RUNNING Partition=gpu\n"
        "JobId=3 JobState=PENDING Partition=cpu\n"
        "JobId=4 JobState=COMPLETED Partition=gpu\n"
    )
    now = 1_800_000_000.0
    start = datetime.fromtimestamp(now + 600).isoformat(timespec="seconds")
    queue = queue_state(jobs, "gpu", f"1|{start}\n5|N/A\n", now)
    assert (queue.pending_tasks, queue.running_tasks) == (1, 1)
    assert queue.estimated_wait_s == pytest.approx(600, abs=1)


@pytest.mark.parametrize(
    ("state", "exit_code", "ours", "code", "words"),
    [
        ("PENDING", "0:0", jobs_pb2.JOB_STATE_DELEGATED, 0, ""),
        ("CONFIGURING", "0:0", jobs_pb2.JOB_STATE_DELEGATED, 0, ""),
        ("RUNNING", "0:0", jobs_pb2.JOB_STATE_RUNNING, 0, ""),
        ("COMPLETING", "0:0", jobs_pb2.JOB_STATE_RUNNING, 0, ""),
        ("COMPLETED", "0:0", jobs_pb2.JOB_STATE_SUCCEEDED, 0, "completed"),
        ("FAILED", "3:0", jobs_pb2.JOB_STATE_FAILED, 3, "exited with 3 (FAILED)"),
        ("FAILED", "0:9", jobs_pb2.JOB_STATE_FAILED, -9, "killed by SIGKILL"),
        ("TIMEOUT", "0:15", jobs_pb2.JOB_STATE_FAILED, -15, "time limit 00:05:00 (TIMEOUT)"),
        ("NODE_FAIL", "0:0", jobs_pb2.JOB_STATE_FAILED, 0, "lost its node (NODE_FAIL"),
        ("PREEMPTED", "0:15", jobs_pb2.JOB_STATE_FAILED, -15, "preempted"),
        ("BOOT_FAIL", "0:0", jobs_pb2.JOB_STATE_FAILED, 0, "could not boot its node"),
        ("OUT_OF_MEMORY", "0:125", jobs_pb2.JOB_STATE_FAILED, -125, "OUT_OF_MEMORY"),
        ("CANCELLED by 0", "0:15", jobs_pb2.JOB_STATE_CANCELLED, -15, "cancelled in Slurm"),
    ],
)
def test_slurm_states_map_onto_ours(
    state: str, exit_code: str, ours: int, code: int, words: str
) -> None:
    """Each Slurm job state maps onto ours, with the exit code and Slurm's reason."""
    job = record(
        f"JobId=7 JobState={state} Reason=None ExitCode={exit_code} TimeLimit=00:05:00 "
        "Partition=gpu"
    )
    outcome = job_outcome(job)
    assert outcome.state == ours
    assert words in outcome.reason
    assert outcome.interrupted == (state in ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL"))
    if outcome.is_final:
        assert outcome.exit_code == code
        assert outcome.reason.startswith("Slurm job 7 ")


def test_exit_codes_and_durations() -> None:
    """Exit codes read like ``returncode``; time limits read in seconds."""
    assert (parse_exit_code("3:0"), parse_exit_code("0:15"), parse_exit_code("")) == (3, -15, 0)
    assert parse_duration_s("01:00:00") == 3600
    assert parse_duration_s("2-00:00:00") == 172800
    assert parse_duration_s("5") == 300
    assert parse_duration_s("UNLIMITED") == math.inf
    assert parse_duration_s("NONE") is None


def test_job_devices_per_node() -> None:
    """Each node set's ``GRES=...(IDX:...)`` becomes ``node:GPU:index`` labels."""
    assert job_devices(record(JOB)) == ["gpu01:GPU:0", "gpu01:GPU:2", "gpu02:GPU:3"]


def test_comment_names_site_and_task() -> None:
    """A job's comment round-trips the task and is ignored for another site."""
    comment = job_comment("dc-a", ("j1", "main", 3))
    assert parse_comment(comment, "dc-a") == ("j1", "main", 3)
    assert parse_comment(comment, "dc-b") is None
    assert parse_comment(dict(parse_fields(JOB))["Comment"], "dc-a") == ("j1", "main", 3)
    assert parse_comment("federation:dc-a:j1:main:x", "dc-a") is None
    # A tenant's chosen id holds a colon (TENANT:ID); task names and sites never do.
    tenants = job_comment("dc-a", ("team-a:nightly", "main", 2))
    assert parse_comment(tenants, "dc-a") == ("team-a:nightly", "main", 2)


def test_test_only_forecast() -> None:
    """``sbatch --test-only`` gives the expected start and the nodes."""
    text = "sbatch: Job 13 to start at 2026-11-21T10:58:03 using 1 processors on nodes n[1-2] in"
    foreseen = parse_test_only(text)
    assert foreseen is not None
    assert foreseen.nodes == ("n1", "n2")
    assert foreseen.start is not None
    assert parse_test_only("allocation failure: Requested node configuration") is None


def test_sbatch_flags_for_one_replica() -> None:
    """One replica asks for its GPUs as ``--gres`` on one node, with the site's flags."""
    settings = SlurmSettings(
        partition="gpu", account="ml", qos="high", extra_sbatch_args=["--constraint=ib"]
    )
    args = resource_args(gpu_task("pass", gpus=2, timeout_s=90.5), settings, "gpu:a100")
    assert args == [
        "--partition=gpu",
        "--account=ml",
        "--qos=high",
        "--time=2",
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=1",
        "--mem=256",
        "--gres=gpu:a100:2",
        "--constraint=ib",
    ]


def test_sbatch_flags_for_a_gang() -> None:
    """Several replicas are Slurm tasks, each with its own CPUs, memory and GPUs."""
    spec = gpu_task("pass", gpus=1, memory_mib=1000, replicas=3)
    spec.resources.cpu = 1.5
    args = resource_args(spec, SlurmSettings(), "gpu")
    assert args == ["--ntasks=3", "--cpus-per-task=2", "--mem-per-cpu=500", "--gpus-per-task=1"]


def test_batch_script_sets_env_and_protects_ours() -> None:
    """The script quotes the task's env, drops what would widen its devices, then execs."""
    spec = gpu_task("print('hi')")
    spec.env.update(
        {"MSG": "it's $HOME", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "FEDERATION_EPOCH": "99"}
    )
    script = batch_script(spec, ("j1", "main", 3), site="dc-a")
    assert "export MSG='it'\"'\"'s $HOME'" in script
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" not in script
    assert "FEDERATION_EPOCH=3\n" in script
    assert "FEDERATION_CHECKPOINT_DIR" not in script
    assert "FEDERATION_RESTORE_FROM" not in script
    assert script.rstrip().splitlines()[-1].startswith("exec ")


def test_batch_script_restores_from_the_file_the_agent_writes(tmp_path: Path) -> None:
    """With a checkpoint policy the script exports the folder, and each start of the job
    restores from the checkpoint the agent last named in its restore file, if any."""
    spec = gpu_task(
        "import os; print(os.environ['FEDERATION_CHECKPOINT_DIR'], "
        "os.environ.get('FEDERATION_RESTORE_FROM', '-'))"
    )
    restore = tmp_path / "restore from"
    env = {"FEDERATION_CHECKPOINT_DIR": "/ck", "FEDERATION_RESTORE_FROM": "/moved/step-1"}
    script = tmp_path / "job.sh"
    script.write_text(
        batch_script(spec, ("j1", "main", 3), site="dc-a", checkpoint_env=env, restore_file=restore)
    )

    def run() -> str:
        done = subprocess.run(["sh", str(script)], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    assert run() == "/ck /moved/step-1"
    restore.write_text("/ck/step 2")
    assert run() == "/ck /ck/step 2"


def gres_node(*types: tuple[str, str]) -> resources_pb2.Node:
    node = resources_pb2.Node(name="n1")
    for gres, model in types:
        node.devices.add(
            kind=resources_pb2.DEVICE_KIND_GPU,
            vendor="nvidia",
            model=model,
            memory_total_mib=81920 if "80" in model else 32768,
            attributes={"slurm_gres": gres},
        )
    return node


@pytest.mark.parametrize(
    ("acc", "options"),
    [
        ({}, [""]),
        ({"count": 1}, ["gpu"]),
        ({"count": 1, "models": ["A100-80GB"]}, ["gpu:a100"]),
        ({"count": 1, "min_memory_mib": 40000}, ["gpu:a100"]),
        ({"count": 1, "selector": "device.memory_gib < 40.0"}, ["gpu:v100"]),
        ({"count": 1, "models": ["A100-80GB", "V100-32GB"]}, ["gpu"]),
    ],
)
def test_gres_options(acc: dict[str, object], options: list[str]) -> None:
    """Only GRES types whose devices match model, memory or selector are asked for."""
    request = jobs_pb2.AcceleratorRequest(kind=resources_pb2.DEVICE_KIND_GPU, **acc)  # type: ignore[arg-type]
    node = gres_node(("gpu:a100", "A100-80GB"), ("gpu:v100", "V100-32GB"))
    assert gres_options(request, [node], "gpu") == options


def test_gres_options_explain_a_mismatch() -> None:
    """A model the partition lacks is declined naming the types it has."""
    request = jobs_pb2.AcceleratorRequest(count=1, models=["H100-80GB"])
    reason = gres_options(request, [gres_node(("gpu:a100", "A100-80GB"))], "gpu")
    assert isinstance(reason, str)
    assert "gpu:a100 (A100-80GB)" in reason


def test_attributes_every_gres_declares_alike_are_node_labels() -> None:
    """A GRES type declared with ``cuda = "12.4"``: its node meets ``requires: {cuda:
    ">=12.1"}`` (it was refused, the node carrying no cuda label); attributes the node's GRES
    types do not share, and labels Slurm gave, are left as they are."""
    node_line = (
        "NodeName=gpu03 Arch=x86_64 CPUTot=8 RealMemory=16000 State=IDLE Partitions=gpu "
        "Gres=gpu:a100:2 GresUsed=gpu:a100:0"
    )
    models = {
        "a100": GresModel(
            model="A100-80GB", memory_mib=81920, attributes={"cuda": "12.4", "mig": "no"}
        )
    }
    (node,) = cluster_view(parse_records(node_line), "gpu", models).nodes
    assert node.labels["cuda"] == "12.4"
    assert node.labels["slurm_partitions"] == "gpu"
    requires = (("cuda", ">=12.1"),)
    assert unmet(requires, node_labels(node), load_table_files()) is None
    assert unmet((("cuda", ">=12.6"),), node_labels(node), load_table_files()) is not None
    mixed = node_line.replace("Gres=gpu:a100:2", "Gres=gpu:a100:1,gpu:v100:1")
    (node,) = cluster_view(parse_records(mixed), "gpu", models).nodes
    assert "cuda" not in node.labels
