from pathlib import Path

from factory.chart.checks import ChartChecks
from factory.chart.deploy import pinned_image
from factory.chart.package import ChartPackage
from factory.release.catalog import Artifact, Release, TestSummary


def release(chart_digest: str, image_digest: str) -> Release:
    return Release(name="tiny-llama", version="0.1.0", image=Artifact(reference="r/i:t", digest=image_digest),
                   chart=Artifact(reference="oci://r/charts/tiny-llama:0.1.0", digest=chart_digest),
                   tests=TestSummary(passed=True, summary="ok"), time="2026-11-25T00:00:00Z")


def test_deploy_pins_the_image_the_release_of_this_chart_pushed():
    chart = ChartPackage(Path("c.tgz"), "sha256:" + "c" * 64, "r/i:t", ChartChecks([], {}))
    image = "sha256:" + "1" * 64
    catalog = [release("sha256:" + "0" * 64, "sha256:" + "9" * 64), release(chart.digest, image)]
    assert pinned_image(chart, catalog) == {"image": {"digest": image}}
    assert pinned_image(chart, catalog[:1]) == {}, "a chart no release was made from: its tag only"
