"""odeify: compile trained residual networks into continuous-in-depth ODE models.

Usage::

    import odeify
    plan = odeify.analyze("resnet50")                # residual blocks and runs
    ode = odeify.convert("resnet50", pretrained=True)  # exact at native depth
    rk4 = odeify.retarget(ode, integrator="rk4", steps=2)

The names below are imported on first use, so that ``import odeify`` (and ``odeify --help``)
does not wait for torch and timm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "analyze": "odeify.analysis",
    "convert": "odeify.conversion",
    "converted_stages": "odeify.conversion",
    "retarget": "odeify.conversion",
    "set_backward": "odeify.conversion",
    "ConfigError": "odeify.errors",
    "FallbackWarning": "odeify.errors",
    "ModelLoadError": "odeify.errors",
    "NoResidualBlocksError": "odeify.errors",
    "OdeifyError": "odeify.errors",
    "TraceError": "odeify.errors",
    "load": "odeify.io",
    "model_code": "odeify.listing",
    "save": "odeify.io",
    "load_model": "odeify.loading",
    "Block": "odeify.plan",
    "Plan": "odeify.plan",
    "Run": "odeify.plan",
    "ODEStage": "odeify.stage",
    "Tableau": "odeify.tableaus",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use, then keep it here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'odeify' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # explicit re-exports, for type checkers and IDEs
    from odeify.analysis import analyze as analyze
    from odeify.conversion import convert as convert
    from odeify.conversion import converted_stages as converted_stages
    from odeify.conversion import retarget as retarget
    from odeify.conversion import set_backward as set_backward
    from odeify.errors import ConfigError as ConfigError
    from odeify.errors import FallbackWarning as FallbackWarning
    from odeify.errors import ModelLoadError as ModelLoadError
    from odeify.errors import NoResidualBlocksError as NoResidualBlocksError
    from odeify.errors import OdeifyError as OdeifyError
    from odeify.errors import TraceError as TraceError
    from odeify.io import load as load
    from odeify.io import save as save
    from odeify.listing import model_code as model_code
    from odeify.loading import load_model as load_model
    from odeify.plan import Block as Block
    from odeify.plan import Plan as Plan
    from odeify.plan import Run as Run
    from odeify.stage import ODEStage as ODEStage
    from odeify.tableaus import Tableau as Tableau
