"""What each built image installs: the router image carries consort_common and consort_router only
(no operator, no engine), read from the archives `make images` writes (~/.cache/consort/images)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
IMAGES = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort")) / "images"
pytestmark = pytest.mark.real_node
SITE_PACKAGE = re.compile(r"(?:^|/)site-packages/(consort_\w+)/__init__\.py$")


def installed_packages(archive: Path) -> set[str]:
    """The consort_* packages under site-packages in any layer of an oci-archive image."""
    found: set[str] = set()
    with tarfile.open(archive) as oci:
        def blob(digest: str):
            return oci.extractfile(f"blobs/{digest.replace(':', '/')}")

        index = json.load(oci.extractfile("index.json"))
        manifest = json.load(blob(index["manifests"][0]["digest"]))
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=blob(layer["digest"]), mode="r|*") as files:
                found |= {m.group(1) for info in files if (m := SITE_PACKAGE.search(info.name))}
    return found


@pytest.fixture(scope="module")
def images() -> Path:
    out = subprocess.run(["make", "-C", str(REPO), "images"], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        pytest.fail(f"make images failed:\n{(out.stdout + out.stderr)[-3000:]}", pytrace=False)
    return IMAGES


def test_the_router_image_installs_no_operator_and_no_engine(images):
    assert installed_packages(images / "router.tar") == {"consort_common", "consort_router"}
