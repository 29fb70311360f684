"""A Triton model's instance count stands in for its stage's parallelism."""

from __future__ import annotations

from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.pressure.thresholds import thresholds_from
from sitsmesh.triton.client import instance_count

PIPELINE = pipeline_from("p", {"stages": [
    {"name": "model", "match": {"upstream_cluster": "triton"}, "triton_model": "bert"},
    {"name": "post", "match": {"upstream_cluster": "post"}}]})


def test_instance_groups_count_their_instances_and_gpus() -> None:
    assert instance_count({}) == 1  # Triton's default
    assert instance_count({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}) == 2
    assert instance_count({"instance_group": [
        {"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}, {"kind": "KIND_CPU"}]}) == 5


def test_learned_instances_set_parallelism_unless_the_thresholds_do() -> None:
    runtime = PressureRuntime(None, clock=lambda: 0.0)
    runtime.set_pipelines({"p": PIPELINE})
    runtime.set_thresholds({"p": thresholds_from({})})
    assert runtime.triton_models() == ["bert"]
    runtime.set_instances("bert", 4)
    configured = runtime.controller.thresholds["p"]
    assert configured.stage("model").parallelism == 4
    assert configured.stage("post").parallelism == 1  # not a Triton stage
    # An SRE's number wins, whether set for the stage or for all of them.
    runtime.set_thresholds({"p": thresholds_from({"stages": {"model": {"parallelism": 2}}})})
    assert runtime.controller.thresholds["p"].stage("model").parallelism == 2
    runtime.set_thresholds({"p": thresholds_from({"parallelism": 3})})
    assert runtime.controller.thresholds["p"].stage("model").parallelism == 3
