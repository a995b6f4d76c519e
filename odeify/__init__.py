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
    "analyze": "odeify.compiler.analysis",
    "calibrate": "odeify.train.calibration",
    "CalibrationReport": "odeify.train.calibration",
    "convert": "odeify.compiler.conversion",
    "converted_stages": "odeify.compiler.conversion",
    "retarget": "odeify.compiler.conversion",
    "set_backward": "odeify.compiler.conversion",
    "set_steps": "odeify.compiler.conversion",
    "source_network": "odeify.compiler.source_network",
    "UnfittedDepthWarning": "odeify.compiler.fitted_depths",
    "verify": "odeify.compiler.conversion",
    "Verification": "odeify.compiler.verification",
    "VerificationError": "odeify.compiler.verification",
    "ConfigError": "odeify.core.errors",
    "FallbackWarning": "odeify.core.errors",
    "KnotRefinementWarning": "odeify.compiler.knot_refinement",
    "NotLiftedWarning": "odeify.compiler.pipelines",
    "ModelLoadError": "odeify.core.errors",
    "NoResidualBlocksError": "odeify.core.errors",
    "OdeifyError": "odeify.core.errors",
    "TraceError": "odeify.core.errors",
    "load": "odeify.serialization.io",
    "model_code": "odeify.inspection.listing",
    "save": "odeify.serialization.io",
    "load_model": "odeify.models.loading",
    "Block": "odeify.ir.plan",
    "Plan": "odeify.ir.plan",
    "Run": "odeify.ir.plan",
    "ODEStage": "odeify.runtime.stage",
    "Tableau": "odeify.numerics.tableaus",
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
    from odeify.compiler.analysis import analyze as analyze
    from odeify.compiler.conversion import convert as convert
    from odeify.compiler.conversion import converted_stages as converted_stages
    from odeify.compiler.conversion import retarget as retarget
    from odeify.compiler.conversion import set_backward as set_backward
    from odeify.compiler.conversion import set_steps as set_steps
    from odeify.compiler.conversion import verify as verify
    from odeify.compiler.fitted_depths import UnfittedDepthWarning as UnfittedDepthWarning
    from odeify.compiler.knot_refinement import KnotRefinementWarning as KnotRefinementWarning
    from odeify.compiler.pipelines import NotLiftedWarning as NotLiftedWarning
    from odeify.compiler.source_network import source_network as source_network
    from odeify.compiler.verification import Verification as Verification
    from odeify.compiler.verification import VerificationError as VerificationError
    from odeify.core.errors import ConfigError as ConfigError
    from odeify.core.errors import FallbackWarning as FallbackWarning
    from odeify.core.errors import ModelLoadError as ModelLoadError
    from odeify.core.errors import NoResidualBlocksError as NoResidualBlocksError
    from odeify.core.errors import OdeifyError as OdeifyError
    from odeify.core.errors import TraceError as TraceError
    from odeify.inspection.listing import model_code as model_code
    from odeify.ir.plan import Block as Block
    from odeify.ir.plan import Plan as Plan
    from odeify.ir.plan import Run as Run
    from odeify.models.loading import load_model as load_model
    from odeify.numerics.tableaus import Tableau as Tableau
    from odeify.runtime.stage import ODEStage as ODEStage
    from odeify.serialization.io import load as load
    from odeify.serialization.io import save as save
    from odeify.train.calibration import CalibrationReport as CalibrationReport
    from odeify.train.calibration import calibrate as calibrate
