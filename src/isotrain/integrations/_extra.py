"""The one-line error for an integration whose framework is not installed."""

from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(module: str, package: str, extra: str) -> ImportError:
    """An ImportError naming the extra that installs ``package`` (pip and a clone's venv)."""
    return ImportError(
        f"{module} needs {package}, which is not installed: pip install 'isotrain[{extra}]' "
        f"(in a clone of isotrain: .venv/bin/pip install -e '.[{extra}]')"
    )
