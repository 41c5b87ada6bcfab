"""Field-level validation of job specs: every problem found, not just the first."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection, Iterator, Mapping

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.common.view_limits import MAX_FIGURE
from federation.coordinator.data.outputs import OUTPUT_NAME_RE, names_dataset, source_of
from federation.coordinator.data.outputs import TASK_OUTPUT as TASK_OUTPUT  # "task:NAME[.OUTPUT]"
from federation.coordinator.jobs.redaction import REDACTED
from federation.coordinator.sites.disconnect import DEFAULT_LOST_AFTER_S
from federation.errors import FieldViolation, InvalidArgumentError
from federation.images import ImageReferenceError, parse_image, registry_problem
from federation.placement.compat import validate_requires
from federation.placement.selectors import SelectorError, check_selector

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_NAME = 63
MAX_TASKS = 64
MAX_REPLICAS = 1024
MAX_CPU = 4096.0
MAX_MEMORY_MIB = 16 * 1024 * 1024
MAX_DEVICES_PER_REPLICA = 64
MAX_COMMAND_BYTES = 64 * 1024
MAX_PRIORITY = 1000
MAX_LABELS = 64
MAX_CHECKPOINT_DIR = 255
MAX_INTERVAL_S = 1e7
MAX_ATTEMPTS = 100
MAX_BACKOFF_S = 86400.0
MAX_PARTS = 256
"""Tasks a job may have once its spread tasks are divided into parts."""
MAX_PORT = 65535
MAX_SPEC_BYTES = 256 * 1024
"""Default for the coordinator's ``max_spec_bytes``."""
MAX_ENTRIES = 64
"""Entries of any list or map in a task beyond command and env (inputs, models, requires...)."""
MAX_ENV = 256
"""Environment variables per task."""
MAX_KEY_CHARS = 256
MAX_PULL_SECRETS = 8
"""Registry logins per task (one per registry)."""
MAX_USERNAME = 256
MAX_PASSWORD_BYTES = 8 * 1024
"""A registry token (a JWT, say) fits; a password longer than this is a mistake."""
"""Longest map key (env, labels, requires) or list item (models, regions, datasets)."""
MAX_VALUE_BYTES = 32 * 1024
"""Longest env value; labels and requires take MAX_KEY_CHARS."""
DEVICE_KINDS = set(resources_pb2.DeviceKind.values()) - {resources_pb2.DEVICE_KIND_UNSPECIFIED}
DOMAINS = set(resources_pb2.Domain.values()) - {resources_pb2.DOMAIN_UNSPECIFIED}


def name_problem(value: str) -> str | None:
    """Why ``value`` is not a valid object name, or None."""
    if len(value) > MAX_NAME:
        return f"is {len(value)} characters long; at most {MAX_NAME} allowed"
    if not NAME_RE.fullmatch(value):
        return (
            f"{_quoted(value)} is not a valid name: use lower-case letters, digits, '.', '_' "
            "and '-', starting and ending with a letter or digit"
        )
    return None


def _quoted(value: str, limit: int = 64) -> str:
    """``value`` quoted for an error message, cut short: messages must not echo huge input."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"… ({len(value)} chars)"


def _sizes(
    path: str, *fields: tuple[str, Collection[str]], most: int = MAX_ENTRIES
) -> Iterator[FieldViolation]:
    """Lists and maps (of strings, or keyed by them) with too many or too long entries."""
    for name, items in fields:
        if len(items) > most:
            yield FieldViolation(f"{path}.{name}", f"at most {most} entries, got {len(items)}")
        elif any(len(item) > MAX_KEY_CHARS for item in items):
            yield FieldViolation(
                f"{path}.{name}", f"entries are at most {MAX_KEY_CHARS} characters"
            )


def _show(value: float) -> str:
    """Exact for whole numbers (no 1.67772e+07), plain otherwise."""
    return str(int(value)) if math.isfinite(value) and float(value).is_integer() else str(value)


def _number(
    path: str, name: str, value: float, low: float, high: float
) -> Iterator[FieldViolation]:
    # The field's path is built only for a violation: specs are checked on the submit path.
    if not low <= value <= high:  # NaN fails too
        yield FieldViolation(
            f"{path}.{name}", f"must be between {_show(low)} and {_show(high)}, got {_show(value)}"
        )


CHECKED_TASKS_KEPT = 1024
"""Task specs whose verdict is kept (``_valid_task``)."""
MAX_CHECKED_TASK_BYTES = 4096
"""Larger task specs are checked every time rather than kept: the verdicts kept take at most
CHECKED_TASKS_KEPT of these, 4 MiB."""


def task_violations(task: jobs_pb2.TaskSpec, path: str) -> list[FieldViolation]:
    """Every problem with one task's spec on its own (not with the job around it).

    Whether a task spec is valid depends on the spec alone, and a sweep or an array of jobs
    submits one task spec thousands of times: the verdicts on the specs seen last are kept,
    by their encoding, so checking a valid one again costs its encoding. The problems of an
    invalid one are found anew (kept, they could take far more room than the spec).
    """
    if task.ByteSize() <= MAX_CHECKED_TASK_BYTES and _valid_task(
        task.SerializeToString(deterministic=True)
    ):
        return []
    return list(_task_violations(task, path))


@functools.lru_cache(maxsize=CHECKED_TASKS_KEPT)
def _valid_task(encoded: bytes) -> bool:
    """Whether the task spec encoded so has no problem."""
    task = jobs_pb2.TaskSpec.FromString(encoded)
    return next(_task_violations(task, ""), None) is None


def _task_violations(task: jobs_pb2.TaskSpec, path: str) -> Iterator[FieldViolation]:
    if not task.name:
        yield FieldViolation(f"{path}.name", "is required")
    elif problem := name_problem(task.name):
        yield FieldViolation(f"{path}.name", problem)
    if not task.command or not task.command[0]:
        yield FieldViolation(f"{path}.command", "is empty; give the program and its arguments")
    elif sum(len(arg.encode()) for arg in task.command) > MAX_COMMAND_BYTES:
        yield FieldViolation(f"{path}.command", f"is longer than {MAX_COMMAND_BYTES} bytes")
    if len(task.env) > MAX_ENV:
        yield FieldViolation(f"{path}.env", f"at most {MAX_ENV} variables, got {len(task.env)}")
    for key, value in task.env.items():
        if len(key) > MAX_KEY_CHARS or not ENV_KEY_RE.fullmatch(key):
            yield FieldViolation(
                f"{path}.env", f"{_quoted(key)} is not a valid environment variable"
            )
        elif len(value.encode()) > MAX_VALUE_BYTES:
            yield FieldViolation(f"{path}.env[{key}]", f"is longer than {MAX_VALUE_BYTES} bytes")
    yield from _sizes(
        path,
        ("resources.accelerator.models", task.resources.accelerator.models),
        ("requires", task.requires),
        ("inputs", [i.dataset for i in task.inputs]),
        ("outputs", [o.path for o in task.outputs]),
        ("depends_on", task.depends_on),
        ("speed", task.speed),
    )
    for key, value in task.requires.items():
        if len(value) > MAX_KEY_CHARS:
            yield FieldViolation(f"{path}.requires[{key}]", f"is over {MAX_KEY_CHARS} characters")
    yield from _number(path, "replicas", task.replicas, 0, MAX_REPLICAS)
    res = task.resources
    yield from _number(path, "resources.cpu", res.cpu, 0, MAX_CPU)
    yield from _number(path, "resources.memory_mib", res.memory_mib, 0, MAX_MEMORY_MIB)
    if res.HasField("accelerator"):
        yield from _accelerator_violations(res.accelerator, f"{path}.resources.accelerator")
    yield from _number(path, "estimated_duration_s", task.estimated_duration_s, 0, 1e9)
    yield from _number(path, "timeout_s", task.timeout_s, 0, 1e9)
    if task.image:
        try:
            parse_image(task.image)
        except ImageReferenceError as err:
            yield FieldViolation(f"{path}.image", str(err))
    yield from _pull_secret_violations(task, path)
    for level in ("required", "preferred"):
        value = getattr(task.topology, level)
        if len(value) > MAX_KEY_CHARS or any(c.isspace() or not c.isprintable() for c in value):
            yield FieldViolation(
                f"{path}.topology.{level}",
                f"{_quoted(value)} must be a node label name: at most {MAX_KEY_CHARS} "
                "characters, without spaces",
            )
    for key, problem in validate_requires(task.requires):
        yield FieldViolation(f"{path}.requires[{key}]", problem)
    for i, item in enumerate(task.inputs):
        if not item.dataset:
            yield FieldViolation(f"{path}.inputs[{i}].dataset", "is required")
        elif item.site and (problem := name_problem(item.site)):
            yield FieldViolation(f"{path}.inputs[{i}].site", problem)
        if item.path and (problem := _relative_path_problem(item.path)):
            yield FieldViolation(f"{path}.inputs[{i}].path", problem)
    yield from _output_violations(task, path)
    for model, factor in task.speed.items():
        if not math.isfinite(factor) or factor <= 0:
            yield FieldViolation(f"{path}.speed[{model}]", f"must be positive, got {factor}")
    if task.HasField("checkpoint"):
        yield from _checkpoint_violations(task.checkpoint, f"{path}.checkpoint")
    if task.HasField("retry"):
        yield from _retry_violations(task.retry, f"{path}.retry")
    if task.HasField("spread"):
        yield from _spread_violations(task, f"{path}.spread")
    yield from _kind_violations(task, path)


def _pull_secret_violations(task: jobs_pb2.TaskSpec, path: str) -> Iterator[FieldViolation]:
    """Registry logins: only with an image, one per registry, each whole. No message repeats
    a password (a refusal is shown to the tenant and may be logged)."""
    secrets = task.image_pull_secrets
    if secrets and not task.image:
        yield FieldViolation(f"{path}.image_pull_secrets", "are only for a task that names image")
    if len(secrets) > MAX_PULL_SECRETS:
        yield FieldViolation(
            f"{path}.image_pull_secrets", f"at most {MAX_PULL_SECRETS}, got {len(secrets)}"
        )
    seen: set[str] = set()
    for i, secret in enumerate(secrets):
        at = f"{path}.image_pull_secrets[{i}]"
        if not secret.registry:
            yield FieldViolation(f"{at}.registry", "is required (host[:port], as image names it)")
        elif problem := registry_problem(secret.registry):
            yield FieldViolation(f"{at}.registry", problem)
        elif secret.registry in seen:
            yield FieldViolation(f"{at}.registry", f"{secret.registry} has a login already")
        seen.add(secret.registry)
        if not secret.username:
            yield FieldViolation(f"{at}.username", "is required")
        elif (
            len(secret.username) > MAX_USERNAME
            or ":" in secret.username
            or any(c.isspace() or not c.isprintable() for c in secret.username)
        ):
            yield FieldViolation(
                f"{at}.username",
                f"must be at most {MAX_USERNAME} printable characters, without ':' or spaces",
            )
        if not secret.password:
            yield FieldViolation(f"{at}.password", "is required (a password or an access token)")
        elif secret.password == REDACTED:
            yield FieldViolation(
                f"{at}.password",
                "is '<redacted>', as a job read back shows it: give the password itself",
            )
        elif (
            len(secret.password.encode()) > MAX_PASSWORD_BYTES or not secret.password.isprintable()
        ):
            yield FieldViolation(
                f"{at}.password",
                f"must be at most {MAX_PASSWORD_BYTES} bytes of printable characters",
            )


def _relative_path_problem(value: str) -> str | None:
    """Why ``value`` is not a path inside a work folder, or None."""
    if value.startswith("/") or "\x00" in value:
        return f"{_quoted(value)} must be relative to the task's work folder"
    if ".." in value.split("/") or value.strip("/.") == "":
        return f"{_quoted(value)} must name a file or folder inside the work folder, without '..'"
    if len(value) > MAX_KEY_CHARS:
        return f"is over {MAX_KEY_CHARS} characters"
    return None


def _output_violations(task: jobs_pb2.TaskSpec, path: str) -> Iterator[FieldViolation]:
    seen: set[str] = set()
    for i, output in enumerate(task.outputs):
        if not OUTPUT_NAME_RE.fullmatch(output.name):
            yield FieldViolation(
                f"{path}.outputs[{i}].name",
                f"{_quoted(output.name)} is not a valid output name: use lower-case letters, "
                "digits, '_' and '-' (no '.'), starting and ending with a letter or digit",
            )
        elif output.name in seen:
            yield FieldViolation(f"{path}.outputs[{i}].name", f"{output.name!r} is declared twice")
        seen.add(output.name)
        if not output.path:
            yield FieldViolation(f"{path}.outputs[{i}].path", "is required")
        elif problem := _relative_path_problem(output.path):
            yield FieldViolation(f"{path}.outputs[{i}].path", problem)
    if task.outputs and task.kind == jobs_pb2.TASK_KIND_SERVICE:
        yield FieldViolation(
            f"{path}.outputs", "a service never succeeds, so its outputs would never be stored"
        )
    if task.outputs and task.HasField("spread"):
        yield FieldViolation(f"{path}.outputs", "a divided task's outputs cannot be staged yet")


def _spread_violations(task: jobs_pb2.TaskSpec, path: str) -> Iterator[FieldViolation]:
    spread = task.spread
    replicas = max(1, task.replicas)
    if spread.part_replicas > MAX_REPLICAS:
        yield from _number(path, "part_replicas", spread.part_replicas, 0, MAX_REPLICAS)
    elif replicas % max(1, spread.part_replicas):
        yield FieldViolation(
            f"{path}.part_replicas",
            f"must divide replicas ({spread.part_replicas} does not divide {replicas})",
        )
    if spread.topology not in jobs_pb2.Spread.Topology.values():
        yield FieldViolation(
            f"{path}.topology",
            f"unknown topology {spread.topology}; expected site, domain or region",
        )
    yield from _number(path, "max_skew", spread.max_skew, 0, MAX_REPLICAS)
    part = max(1, spread.part_replicas)
    yield from _number(path, "rendezvous_port", spread.rendezvous_port, 0, MAX_PORT - part + 1)
    if spread.rendezvous_port and not spread.all_or_nothing:
        yield FieldViolation(
            f"{path}.rendezvous_port", "is for a gang's rendezvous: give all_or_nothing too"
        )
    if not spread.site_weights:
        return
    yield from _sizes(path, ("site_weights", spread.site_weights))
    # Sites may join later: a weight may name a site not known yet, whose parts wait for it.
    for site, weight in sorted(spread.site_weights.items()):
        if problem := name_problem(site):
            yield FieldViolation(f"{path}.site_weights[{_quoted(site)}]", problem)
        elif weight < 1:
            yield FieldViolation(f"{path}.site_weights[{site}]", f"must be positive, got {weight}")
    if spread.max_skew:
        yield FieldViolation(
            f"{path}.max_skew",
            "give max_skew or site_weights, not both: static weights fix each part's site",
        )
    if spread.topology in (jobs_pb2.Spread.TOPOLOGY_DOMAIN, jobs_pb2.Spread.TOPOLOGY_REGION):
        yield FieldViolation(
            f"{path}.topology", "site_weights divide parts by site: leave topology unset or site"
        )


def part_count(task: jobs_pb2.TaskSpec) -> int:
    """Tasks ``task`` becomes once divided by its spread: 1 without one."""
    if not task.HasField("spread"):
        return 1
    return max(1, task.replicas) // max(1, task.spread.part_replicas)


def _kind_violations(task: jobs_pb2.TaskSpec, path: str) -> Iterator[FieldViolation]:
    """A service runs until it is cancelled: what only makes sense for work that ends (a
    timeout, retries of a failed run) is refused, and its policy only comes with the kind."""
    if task.kind not in jobs_pb2.TaskKind.values():
        yield FieldViolation(f"{path}.kind", f"unknown kind {task.kind}; expected batch or service")
        return
    if task.kind != jobs_pb2.TASK_KIND_SERVICE:
        if task.HasField("service"):
            yield FieldViolation(f"{path}.service", "is only for a task of kind service")
        return
    if task.timeout_s:
        yield FieldViolation(
            f"{path}.timeout_s", "a service runs until it is cancelled: give no timeout"
        )
    if task.HasField("retry"):
        yield FieldViolation(
            f"{path}.retry", "a service's replicas are restarted by service.restart, not retried"
        )
    if task.HasField("spread"):
        yield FieldViolation(f"{path}.spread", "a service's replicas run at one site")
    yield from _service_violations(task.service, task.replicas or 1, f"{path}.service")


def _service_violations(
    policy: jobs_pb2.ServicePolicy, replicas: int, path: str
) -> Iterator[FieldViolation]:
    if policy.restart not in jobs_pb2.ServicePolicy.Restart.values():
        yield FieldViolation(
            f"{path}.restart", f"unknown policy {policy.restart}; expected always or on_failure"
        )
    yield from _backoff_violations(policy.backoff_s, policy.max_backoff_s, path)
    yield from _number(path, "min_run_s", policy.min_run_s, 0, MAX_BACKOFF_S)
    yield from _number(path, "crash_loop_after", policy.crash_loop_after, 0, MAX_ATTEMPTS)
    yield from _number(path, "port", policy.port, 0, MAX_PORT)
    yield from _number(path, "max_unavailable", policy.max_unavailable, 0, replicas)
    if len(policy.near_region) > MAX_KEY_CHARS:
        yield FieldViolation(f"{path}.near_region", f"is over {MAX_KEY_CHARS} characters")
    if policy.HasField("readiness"):
        yield from _readiness_violations(policy.readiness, f"{path}.readiness")
    if policy.HasField("autoscale"):
        yield from _autoscale_violations(policy.autoscale, replicas, f"{path}.autoscale")


METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
"""A Prometheus metric name."""


def _autoscale_violations(
    scale: jobs_pb2.Autoscale, replicas: int, path: str
) -> Iterator[FieldViolation]:
    yield from _number(path, "min_replicas", scale.min_replicas, 1, MAX_REPLICAS)
    yield from _number(path, "max_replicas", scale.max_replicas, scale.min_replicas, MAX_REPLICAS)
    if not 0 < scale.target_load <= MAX_FIGURE:
        yield FieldViolation(
            f"{path}.target_load",
            f"must be above 0 and at most {_show(MAX_FIGURE)}, got {_show(scale.target_load)}",
        )
    yield from _url_path_violations(scale.load_path, f"{path}.load_path")
    if scale.load_metric and not (
        len(scale.load_metric) <= MAX_KEY_CHARS and METRIC_NAME_RE.fullmatch(scale.load_metric)
    ):
        yield FieldViolation(
            f"{path}.load_metric", f"{_quoted(scale.load_metric)} is not a Prometheus metric name"
        )
    for name in ("scale_down_after_s", "drain_timeout_s"):
        yield from _number(path, name, getattr(scale, name), 0, MAX_INTERVAL_S)
    if scale.min_replicas <= scale.max_replicas and not (
        scale.min_replicas <= replicas <= scale.max_replicas
    ):
        yield FieldViolation(
            path.removesuffix(".service.autoscale") + ".replicas",
            f"{replicas} is outside autoscale's {scale.min_replicas} to {scale.max_replicas}",
        )


def _url_path_violations(value: str, path: str) -> Iterator[FieldViolation]:
    if (
        not value.startswith("/")
        or len(value) > MAX_KEY_CHARS
        or any(c.isspace() or not c.isprintable() for c in value)
    ):
        yield FieldViolation(
            path,
            f"{_quoted(value)} must be a URL path starting with '/', without spaces, "
            f"at most {MAX_KEY_CHARS} characters",
        )


def _readiness_violations(check: jobs_pb2.ReadinessCheck, path: str) -> Iterator[FieldViolation]:
    kind = check.WhichOneof("check")
    if kind is None:
        yield FieldViolation(path, "give one of tcp_port, http_path or command")
    elif kind == "tcp_port":
        yield from _number(path, "tcp_port", check.tcp_port, 1, MAX_PORT)
    elif kind == "http_path":
        yield from _url_path_violations(check.http_path, f"{path}.http_path")
    elif not check.command.argv or not check.command.argv[0]:
        yield FieldViolation(f"{path}.command.argv", "is empty; give the program and its arguments")
    elif sum(len(arg.encode()) for arg in check.command.argv) > MAX_COMMAND_BYTES:
        yield FieldViolation(f"{path}.command.argv", f"is longer than {MAX_COMMAND_BYTES} bytes")
    for name in ("period_s", "timeout_s", "initial_delay_s"):
        yield from _number(path, name, getattr(check, name), 0, MAX_INTERVAL_S)


def _retry_violations(retry: jobs_pb2.RetryPolicy, path: str) -> Iterator[FieldViolation]:
    yield from _number(path, "max_attempts", retry.max_attempts, 0, MAX_ATTEMPTS)
    yield from _backoff_violations(retry.backoff_s, retry.max_backoff_s, path)


def _backoff_violations(
    backoff_s: float, max_backoff_s: float, path: str
) -> Iterator[FieldViolation]:
    """A first wait and its cap (retries, service restarts): each in range, the cap not shorter."""
    yield from _number(path, "backoff_s", backoff_s, 0, MAX_BACKOFF_S)
    yield from _number(path, "max_backoff_s", max_backoff_s, 0, MAX_BACKOFF_S)
    if 0 < max_backoff_s < backoff_s:
        yield FieldViolation(
            f"{path}.max_backoff_s",
            f"is shorter than backoff_s ({_show(max_backoff_s)} < {_show(backoff_s)})",
        )


def _checkpoint_violations(checkpoint: jobs_pb2.Checkpoint, path: str) -> Iterator[FieldViolation]:
    folder = checkpoint.dir
    parts = folder.split("/")
    if folder and (
        folder.startswith("/")
        or len(folder) > MAX_CHECKPOINT_DIR
        or "\0" in folder
        or any(part in ("", ".", "..") for part in parts)
    ):
        yield FieldViolation(
            f"{path}.dir",
            f"{folder!r} must be a relative path inside the task's work folder, such as "
            "'checkpoints' or 'out/ckpt' (no '..', no leading '/')",
        )
    yield from _number(path, "interval_s", checkpoint.interval_s, 0, MAX_INTERVAL_S)


def _accelerator_violations(
    acc: jobs_pb2.AcceleratorRequest, path: str
) -> Iterator[FieldViolation]:
    asks = [
        name
        for name, on in (
            ("count", acc.count),
            ("fraction", acc.fraction),
            ("partition", acc.partition),
        )
        if on
    ]
    if not asks and not (acc.kind or acc.models or acc.vendor or acc.selector):
        return
    if acc.kind not in DEVICE_KINDS:
        yield FieldViolation(
            f"{path}.kind",
            f"unknown accelerator kind {acc.kind}; expected GPU, NPU, MLU, FPGA or DPU",
        )
    if len(asks) > 1:
        yield FieldViolation(
            f"{path}.{asks[1]}",
            f"ask for one of count, fraction or partition, not {' and '.join(asks)}",
        )
    if (not asks or acc.count) and (acc.count < 1 or acc.count > MAX_DEVICES_PER_REPLICA):
        yield FieldViolation(
            f"{path}.count", f"must be between 1 and {MAX_DEVICES_PER_REPLICA}, got {acc.count}"
        )
    if acc.fraction and not (0 < acc.fraction <= 1):
        yield FieldViolation(f"{path}.fraction", f"must be in (0, 1], got {_show(acc.fraction)}")
    if acc.memory_mib and not acc.fraction:
        yield FieldViolation(
            f"{path}.memory_mib", "is the memory of a share: give it with fraction"
        )
    if acc.selector:
        try:
            check_selector(acc.selector)
        except SelectorError as err:
            yield FieldViolation(f"{path}.selector", str(err))


def _dependency_violations(spec: jobs_pb2.JobSpec, path: str) -> Iterator[FieldViolation]:
    """Unknown or self dependencies, task outputs read without depending on them, cycles."""
    if not any(
        t.depends_on or any(i.dataset.startswith(TASK_OUTPUT) for i in t.inputs) for t in spec.tasks
    ):
        return  # most jobs: nothing to check
    names = {t.name for t in spec.tasks}
    specs = {t.name: t for t in spec.tasks}
    services = {t.name for t in spec.tasks if t.kind == jobs_pb2.TASK_KIND_SERVICE}
    graph: dict[str, list[str]] = {}
    for i, task in enumerate(spec.tasks):
        graph[task.name] = list(task.depends_on)
        for j, dep in enumerate(task.depends_on):
            if dep == task.name:
                yield FieldViolation(
                    f"{path}.tasks[{i}].depends_on[{j}]", "a task cannot depend on itself"
                )
            elif dep not in names:
                yield FieldViolation(
                    f"{path}.tasks[{i}].depends_on[{j}]", f"no task {_quoted(dep)} in this job"
                )
            elif dep in services:
                yield FieldViolation(
                    f"{path}.tasks[{i}].depends_on[{j}]",
                    f"{_quoted(dep)} is a service, which never succeeds: nothing could follow it",
                )
        for j, item in enumerate(task.inputs):
            yield from _input_violations(item, specs, task, f"{path}.tasks[{i}].inputs[{j}]")
    if cycle := find_cycle(graph):
        yield FieldViolation(f"{path}.tasks", f"dependency cycle: {' -> '.join(cycle)}")


def _input_violations(
    item: jobs_pb2.DataInput,
    specs: Mapping[str, jobs_pb2.TaskSpec],
    task: jobs_pb2.TaskSpec,
    path: str,
) -> Iterator[FieldViolation]:
    """A ``task:`` input: the output it names exists, and its task is depended on."""
    if not item.dataset.startswith(TASK_OUTPUT):
        if item.path and not names_dataset(item.dataset):
            yield FieldViolation(
                f"{path}.path",
                "is only for a task's output (task:NAME.OUTPUT) or a registered dataset "
                "(dataset:NAME)",
            )
        return
    name = item.dataset.removeprefix(TASK_OUTPUT)
    found = source_of(item.dataset, specs)
    producer = found[0] if found is not None else name
    if found is None and (task_name := name.rpartition(".")[0]) in specs:
        declared = ", ".join(o.name for o in specs[task_name].outputs) or "none"
        yield FieldViolation(
            f"{path}.dataset",
            f"task {task_name!r} declares no output {name.rpartition('.')[2]!r} "
            f"(it declares: {declared})",
        )
        return
    if found is not None and found[1] is None and specs[producer].outputs:
        yield FieldViolation(
            f"{path}.dataset",
            f"task {producer!r} declares {len(specs[producer].outputs)} outputs; name one: "
            f"task:{producer}.OUTPUT",
        )
    if producer not in task.depends_on:
        yield FieldViolation(
            f"{path}.dataset", f"reads the output of {producer!r}; add it to depends_on"
        )
    if item.path and (found is None or found[1] is None):
        yield FieldViolation(f"{path}.path", "is only for a task's declared output")


def find_cycle(graph: dict[str, list[str]]) -> list[str]:
    """One dependency cycle as a path (first node repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in graph.get(node, []):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep in graph and state.get(dep) is None and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in graph:
        if state.get(node) is None and (found := visit(node)):
            return found
    return []


def spec_violations(
    spec: jobs_pb2.JobSpec, path: str = "spec", max_bytes: int = MAX_SPEC_BYTES
) -> list[FieldViolation]:
    """Every problem with ``spec``; an empty list means it is valid.

    A spec over ``max_bytes`` is refused for its size alone, before anything in it is read.
    """
    size = spec.ByteSize()
    if size > max_bytes:
        return [FieldViolation(path, f"is {size} bytes encoded; at most {max_bytes} allowed")]
    out: list[FieldViolation] = []
    if spec.id and (problem := name_problem(spec.id)):
        out.append(FieldViolation(f"{path}.id", problem))
    if not spec.name:
        out.append(FieldViolation(f"{path}.name", "is required"))
    elif len(spec.name) > MAX_NAME:
        out.append(
            FieldViolation(f"{path}.name", f"is {len(spec.name)} characters; at most {MAX_NAME}")
        )
    if spec.tenant and (problem := name_problem(spec.tenant)):
        out.append(FieldViolation(f"{path}.tenant", problem))
    out.extend(_number(path, "priority", spec.priority, -MAX_PRIORITY, MAX_PRIORITY))
    if not spec.tasks:
        out.append(FieldViolation(f"{path}.tasks", "a job needs at least one task"))
    elif len(spec.tasks) > MAX_TASKS:
        out.append(FieldViolation(f"{path}.tasks", f"at most {MAX_TASKS} tasks per job"))
    seen: set[str] = set()
    parts = 0
    for i, task in enumerate(spec.tasks[:MAX_TASKS]):
        out.extend(task_violations(task, f"{path}.tasks[{i}]"))
        if task.name in seen:
            out.append(FieldViolation(f"{path}.tasks[{i}].name", f"duplicate task {task.name!r}"))
        seen.add(task.name)
        count = part_count(task)
        parts += count
        if count > 1 and parts > MAX_PARTS:
            out.append(
                FieldViolation(
                    f"{path}.tasks[{i}].spread.part_replicas",
                    f"divides {max(1, task.replicas)} replicas into {count} parts: the job "
                    f"would have {parts} tasks and parts; at most {MAX_PARTS}",
                )
            )
    out.extend(_dependency_violations(spec, path))
    # Most jobs leave these messages unset, whose defaults are valid: reading a field of an
    # unset message still builds it, on the submit path.
    if spec.HasField("objective"):
        for name, value in (
            ("deadline_s", spec.objective.deadline_s),
            ("max_cost_usd", spec.objective.max_cost_usd),
        ):
            out.extend(_number(path, f"objective.{name}", value, 0, 1e12))
    constraints = spec.constraints if spec.HasField("constraints") else None
    if constraints is not None:
        for i, domain in enumerate(constraints.domains):
            if domain not in DOMAINS:
                out.append(
                    FieldViolation(f"{path}.constraints.domains[{i}]", f"unknown domain {domain}")
                )
        for i, site in enumerate(constraints.sites):
            if problem := name_problem(site):
                out.append(FieldViolation(f"{path}.constraints.sites[{i}]", problem))
    if spec.HasField("disconnect"):
        policy = spec.disconnect
        out.extend(_number(path, "disconnect.lost_after_s", policy.lost_after_s, 0, MAX_INTERVAL_S))
        out.extend(_number(path, "disconnect.stop_after_s", policy.stop_after_s, 0, MAX_INTERVAL_S))
        lost_after_s = policy.lost_after_s or DEFAULT_LOST_AFTER_S
        if policy.stop_after_s > 0 and policy.stop_after_s > lost_after_s:
            # The replacement would start while the cut-off copy still runs.
            out.append(
                FieldViolation(
                    f"{path}.disconnect.stop_after_s",
                    f"is longer than lost_after_s ({_show(policy.stop_after_s)} > "
                    f"{_show(lost_after_s)}): a replacement would run beside the cut-off copy",
                )
            )
        if policy.reconcile not in jobs_pb2.Reconcile.values():
            out.append(
                FieldViolation(
                    f"{path}.disconnect.reconcile",
                    f"unknown rule {policy.reconcile}; expected keep_replacement, "
                    "keep_original or best",
                )
            )
    if len(spec.labels) > MAX_LABELS:
        out.append(FieldViolation(f"{path}.labels", f"at most {MAX_LABELS} labels"))
    mappings: list[tuple[str, Mapping[str, str]]] = [("labels", spec.labels)]
    if constraints is not None:
        out.extend(
            _sizes(
                path,
                ("constraints.regions", constraints.regions),
                ("constraints.sites", constraints.sites),
                ("constraints.node_labels", constraints.node_labels),
                most=MAX_LABELS,
            )
        )
        mappings.append(("constraints.node_labels", constraints.node_labels))
    for name, mapping in mappings:
        if any(len(k) > MAX_KEY_CHARS or len(v) > MAX_KEY_CHARS for k, v in mapping.items()):
            out.append(
                FieldViolation(
                    f"{path}.{name}", f"keys and values are at most {MAX_KEY_CHARS} characters"
                )
            )
    return out


def validate_spec(
    spec: jobs_pb2.JobSpec, path: str = "spec", max_bytes: int = MAX_SPEC_BYTES
) -> None:
    """Raise ``InvalidArgumentError`` listing every problem with ``spec``."""
    if violations := spec_violations(spec, path, max_bytes):
        raise InvalidArgumentError(violations)
