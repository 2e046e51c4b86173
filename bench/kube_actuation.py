"""The Kubernetes backend's scale path in a namespace of many HPAs: a minute's plan, with and without the HPA map.

Every scale or release asks which HorizontalPodAutoscaler scales the model's Deployment, twice (its floor and
reactive ask, then the patch). Before :class:`~forecaster.actuation.backends.kubernetes.HpaIndex` each question
listed every HPA of the namespace; now one LIST per namespace every ``PREWARM_KUBERNETES_HPA_INDEX_TTL_S`` (60 s)
names them and a GET reads the one needed. ``hpa_index_ttl_s = 0`` lists on every lookup, the old cost plus one
GET: the baseline, measured in the same run.

The API server is ``tests/kube_fixtures.FakeKubeApi`` (the real ``kubernetes`` client above its transport), in
this process: its JSON encoding of every LIST is in the wall time, as a real server's work would be on its side
of the network. HPAs carry what a real one does (status conditions and current metrics, the last-applied
annotation) so a LIST weighs what it would; they are validated strictly when seeded, and the fake's validation of
each write (about 18 ms, a test aid, no part of a server's answer time) is off while timing. The actuator runs the plan through its threads
(``actuator_parallelism`` 8) on an in-memory ledger; a plan of ``--actions`` scales or releases, each
model behind an HPA.

    .venv/bin/python bench/kube_actuation.py [--hpas 100,1000] [--actions 200] [--repeats 3]

Measured (2026-12-07, 2 cores, 6 min): 100 HPAs, a plan of 100 actions: 2.93 s with 200 LISTs against 0.08 s with
1 (34.7x); 1,000 HPAs, 200 actions: 105.99 s with 400 LISTs against 0.49 s with 1 (217x).
"""
import argparse
import statistics
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from forecaster.actuation.actuator import Actuator  # noqa: E402
from forecaster.actuation.backends.base import ModelTarget  # noqa: E402
from forecaster.actuation.backends.kubernetes import KubernetesBackend  # noqa: E402
from forecaster.actuation.ledger import MemoryLedger  # noqa: E402
from forecaster.contracts.actions import Action, ActionKind, ActionStatus, Plan, Reason  # noqa: E402
from forecaster.settings import Settings  # noqa: E402
import tests.kube_fixtures as kube_fixtures  # noqa: E402
from tests.kube_fixtures import FakeKubeApi, deployment, hpa  # noqa: E402

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)


def realistic_hpa(model: str) -> dict:
    obj = hpa(f"{model}-hpa", model, min_replicas=1, max_replicas=16, desired=2)
    obj["metadata"]["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": "{" + "x" * 600 + "}"}
    obj["status"]["conditions"] = [
        {"type": kind, "status": "True", "lastTransitionTime": "2026-12-01T00:00:00Z", "reason": "Ready",
         "message": "the HPA controller was able to get the target's current scale and compute a replica count"}
        for kind in ("AbleToScale", "ScalingActive", "ScalingLimited")]
    obj["status"]["currentMetrics"] = [{"type": "Resource", "resource": {
        "name": "cpu", "current": {"averageUtilization": 52, "averageValue": "1040m"}}}]
    return obj


def fake_cluster(n_hpas: int) -> FakeKubeApi:
    api = FakeKubeApi()
    for i in range(n_hpas):
        model = f"model-{i:05d}"
        api.put(deployment(model, replicas=2))
        api.put(realistic_hpa(model))
    return api


def one_plan(api: FakeKubeApi, models: list[str], ttl_s: float, kind: ActionKind) -> dict:
    """A fresh backend (no listing yet) carries out one plan (scales to 4, or releases to the HPAs' ask of 2)."""
    settings = Settings(actuator_backend="kubernetes", kubernetes_hpa_index_ttl_s=ttl_s, actuator_parallelism=8)
    backend = KubernetesBackend.from_settings(settings, api_client=api.client(), clock=lambda: NOW,
                                              sleep=lambda s: None)
    actuator = Actuator(MemoryLedger({m: ModelTarget(m) for m in models}), settings, backend)
    scale = kind is ActionKind.SCALE
    actions = tuple(Action(kind=kind, model_id=m, reason=Reason.FORECAST_SPIKE if scale else Reason.IDLE_RELEASE,
                           not_before=NOW, deadline=NOW + timedelta(minutes=10), replicas=4 if scale else 2)
                    for m in models)
    api.requests.clear()
    t0 = time.perf_counter()
    _, reports = actuator.apply(Plan(planned_at=NOW, actions=actions), now=NOW)
    wall_s = time.perf_counter() - t0
    failed = [r for r in reports if r.status is not ActionStatus.SUCCEEDED]
    if failed:
        raise SystemExit(f"{len(failed)} actions did not succeed, e.g. {failed[0]}")
    lists = sum(1 for method, path, _ in api.requests if method == "GET" and path.endswith("/horizontalpodautoscalers"))
    patches = sum(1 for method, _, _ in api.requests if method == "PATCH")
    if patches != len(models):
        raise SystemExit(f"{patches} patches for {len(models)} actions: the plans did not do the same work")
    return {"wall_s": wall_s, "lists": lists, "requests": len(api.requests)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hpas", default="100,1000", help="Comma list of HPAs in the namespace.")
    parser.add_argument("--actions", type=int, default=200, help="Actions in the plan (at most --hpas).")
    parser.add_argument("--repeats", type=int, default=3, help="Plans per setting, alternating; the median.")
    args = parser.parse_args()
    print(f"a plan of up to {args.actions} scales or releases, each model behind an HPA; "
          f"median of {args.repeats}, alternating")
    print(f"{'HPAs':>6} {'actions':>7} {'ttl 0 (list each lookup)':>26} {'ttl 60 (default)':>22} {'ratio':>7}")
    for n_hpas in (int(x) for x in args.hpas.split(",")):
        t0 = time.perf_counter()
        api = fake_cluster(n_hpas)
        seeded_s = time.perf_counter() - t0
        validate = kube_fixtures.validate_manifest
        kube_fixtures.validate_manifest = lambda obj: None
        models = [f"model-{i:05d}" for i in range(min(args.actions, n_hpas))]
        runs: dict[float, list[dict]] = {0.0: [], 60.0: []}
        plans = 0
        for _ in range(args.repeats):
            for ttl_s in runs:  # each plan moves every floor (4, 2, 4, ...): the same work under both settings
                kind = ActionKind.SCALE if plans % 2 == 0 else ActionKind.RELEASE
                runs[ttl_s].append(one_plan(api, models, ttl_s, kind))
                plans += 1
        kube_fixtures.validate_manifest = validate
        cells = {}
        for ttl_s, rows in runs.items():
            wall = statistics.median(r["wall_s"] for r in rows)
            cells[ttl_s] = (wall, f"{wall:8.2f} s, {rows[0]['lists']:4d} LISTs")
        print(f"{n_hpas:6d} {len(models):7d} {cells[0.0][1]:>26} {cells[60.0][1]:>22} "
              f"{cells[0.0][0] / cells[60.0][0]:6.1f}x   (seeded in {seeded_s:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
