"""What every process that imports verl loads (the ``verl.plugins`` entry point in pyproject.toml):
the CPU platform, the file checkpoint backend and our advantage estimators, each registered under
its own name on import. Registering selects nothing: a GPU run never names them and is unchanged."""

from inharness.trainer.verl_engine import checkpoint_files, cpu_platform, losses

losses.register_estimators()


def load() -> None:
    """The entry point's object; the registrations happened when this module was imported."""


__all__ = ["checkpoint_files", "cpu_platform", "load"]
