"""`inferkiln deploy`: install or upgrade the release on a real cluster and wait for the rollout.

No cluster runs where inferkiln is built and tested: this path checks the cluster first and fails
with one clear line when none answers.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from factory.chart.package import ChartPackage
from factory.errors import CheckFailed
from factory.release.catalog import Release, releases
from factory.stack import helm_binary


class DeployError(CheckFailed):
    """The cluster is unreachable, helm refused the release, or the rollout did not finish."""


def api_client(kubeconfig: Path):
    from kubernetes import client, config

    try:
        api = config.new_client_from_config(config_file=str(kubeconfig))
    except Exception as exc:  # the loader raises several kinds for unreadable or incomplete files
        raise DeployError(f"{kubeconfig}: not a usable kubeconfig: {exc}") from None
    try:
        client.VersionApi(api).get_code(_request_timeout=5)
    except Exception as exc:
        raise DeployError(f"no Kubernetes cluster reachable at {api.configuration.host}: "
                          f"{type(exc).__name__}") from None
    return api


def wait_for_rollout(api, name: str, namespace: str, timeout: float) -> None:
    from kubernetes import client

    apps = client.AppsV1Api(api)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = apps.read_namespaced_deployment_status(name, namespace)
        wanted = status.spec.replicas or 0
        if (status.status.updated_replicas or 0) >= wanted and (status.status.available_replicas or 0) >= wanted:
            return
        time.sleep(3)
    raise DeployError(f"deployment {namespace}/{name} did not roll out within {timeout:.0f}s")


def pinned_image(chart: ChartPackage, releases: list[Release]) -> dict[str, Any]:
    """Values pinning the image by the digest the registry gave it, where a published release was
    made from this very chart package (the chart is validated before the image is pushed, so only
    the release knows the digest); none otherwise."""
    published = [r for r in releases if r.chart.digest == chart.digest]
    return {"image": {"digest": published[-1].image.digest}} if published else {}


def deploy(chart: ChartPackage, name: str, kubeconfig: Path, namespace: str,
           values: dict[str, Any] | None = None, timeout: float = 1800) -> dict[str, Any]:
    """Install or upgrade the release from the chart package the chart stage validated, its image
    pinned by digest where the catalog records the release."""
    from pyhelm3 import Client

    api = api_client(kubeconfig)
    values = {**pinned_image(chart, releases()), **(values or {})}

    async def install():
        helm = Client(executable=helm_binary(), kubeconfig=kubeconfig)
        chart_ref = await helm.get_chart(chart.path)
        return await helm.install_or_upgrade_release(name, chart_ref, values or {}, namespace=namespace,
                                                     create_namespace=True, atomic=False, wait=False)

    try:
        revision = asyncio.run(install())
    except Exception as exc:
        raise DeployError(f"helm could not install {name} into {namespace}: {exc}") from None
    wait_for_rollout(api, name, namespace, timeout)
    return {"release": name, "namespace": namespace, "revision": getattr(revision, "revision", None)}
