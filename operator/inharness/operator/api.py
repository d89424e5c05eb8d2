"""The project's Kubernetes API, named once: its group, version, and kinds with their plural and
short names. The spec models, the CRD generator, the kube client's resources and the kopf handlers
read them from here, so that a rename or a new version is one edit."""

from dataclasses import dataclass
from typing import Final

GROUP: Final = "inharness.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "inharness.dev/v1alpha1"  # f"{GROUP}/{VERSION}", spelled out for Literal[...]


@dataclass(frozen=True)
class Kind:
    kind: str
    plural: str
    short_name: str


TRAININGRUN = Kind("TrainingRun", "trainingruns", "tr")
ROLLOUTPOOL = Kind("RolloutPool", "rolloutpools", "rp")
HARNESSSPEC = Kind("HarnessSpec", "harnessspecs", "hs")
