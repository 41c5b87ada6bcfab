"""The generator and replay are deterministic under a seed, and the knobs do what they say."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest

from federation.sim.generate import Knobs, generate, write_topology
from federation.sim.replay import replay
from federation.sim.report import write_json
from federation.sim.topology import load_topology
from federation.sim.trace import load_trace, write_trace

SMALL = Knobs(jobs=300, nodes=40, sites=6, datasets=4, dataset_gb=20.0, load=1.5)


def _files(data: Path, out: Path, seed: int, knobs: Knobs = SMALL) -> tuple[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    topology, tasks = generate(knobs, seed, data, out)
    write_topology(out / "topology.yaml", topology)
    write_trace(out / "trace.csv", tasks)
    return (out / "topology.yaml").read_text(), (out / "trace.csv").read_text()


def _replay_json(folder: Path, seed: int) -> str:
    result = replay(
        load_topology(folder / "topology.yaml"),
        load_trace(folder / "trace.csv"),
        ["completion-time", "round-robin", "static-weights"],
        seed=seed,
        estimate_error=0.5,
    )
    out = io.StringIO()
    write_json(result, out)
    return out.getvalue()


def test_the_same_seed_gives_the_same_files_and_the_same_json(
    data_dir: Path, tmp_path: Path
) -> None:
    """Generation and replay depend on the seed alone: equal seeds, equal bytes."""
    first = _files(data_dir, tmp_path / "one", seed=5)
    assert first == _files(data_dir, tmp_path / "two", seed=5)
    assert first != _files(data_dir, tmp_path / "three", seed=6)
    result = _replay_json(tmp_path / "one", seed=1)
    assert result == _replay_json(tmp_path / "one", seed=1)
    assert result != _replay_json(tmp_path / "one", seed=2)  # estimate errors and declines


def test_generated_inputs_parse_and_fit_the_fleet(data_dir: Path, tmp_path: Path) -> None:
    """The files load, every domain appears, and every job fits some site when it is idle."""
    _files(data_dir, tmp_path, seed=3)
    topology = load_topology(tmp_path / "topology.yaml")
    tasks = load_trace(tmp_path / "trace.csv")
    assert len(tasks) == SMALL.jobs
    assert topology.n_nodes == SMALL.nodes
    assert len(topology.sites) == SMALL.sites
    assert {s.domain for s in topology.sites} == {1, 2, 3}
    result = replay(topology, tasks, ["completion-time"])
    figures = result.summary["policies"]["completion-time"]
    assert figures["tasks_that_fit_nowhere"] == 0
    assert figures["jobs_completed"] == SMALL.jobs


def test_load_sets_the_arrival_rate_and_input_share_the_jobs_with_data(
    data_dir: Path, tmp_path: Path
) -> None:
    """Twice the load packs the same jobs into half the time; input_share 1 gives all data."""
    rng_args = (data_dir, tmp_path)
    _, light = generate(dataclasses.replace(SMALL, load=1.0), 4, *rng_args)
    _, heavy = generate(dataclasses.replace(SMALL, load=2.0), 4, *rng_args)
    assert [t.duration_s for t in light] == [t.duration_s for t in heavy]
    ratio = np.array([h.submit_s for h in heavy[10:]]) / np.array([t.submit_s for t in light[10:]])
    assert ratio == pytest.approx(0.5, rel=1e-3)
    _, with_data = generate(dataclasses.replace(SMALL, input_share=1.0), 4, *rng_args)
    assert all(t.dataset for t in with_data)
    _, cpu_only = generate(dataclasses.replace(SMALL, cpu_share=1.0), 4, *rng_args)
    assert not any(t.accelerator_count or t.accelerator_fraction for t in cpu_only)
