"""odeify: compile trained residual networks into continuous-in-depth ODE models.

Usage::

    import odeify
    plan = odeify.analyze("resnet50")                # residual blocks and runs
    ode = odeify.convert("resnet50", pretrained=True)  # exact at native depth
    rk4 = odeify.retarget(ode, integrator="rk4", steps=2)
"""

from odeify.analysis import analyze
from odeify.convert import convert, converted_stages, retarget, set_backward
from odeify.errors import ConfigError, ModelLoadError, NoResidualBlocksError, OdeifyError, TraceError
from odeify.io import load, save
from odeify.models import load_model, make_test_model
from odeify.plan import Block, Plan, Run
from odeify.stage import ODEStage
from odeify.tableaus import Tableau

__all__ = [
    "Block",
    "ConfigError",
    "ModelLoadError",
    "NoResidualBlocksError",
    "ODEStage",
    "OdeifyError",
    "Plan",
    "Run",
    "Tableau",
    "TraceError",
    "analyze",
    "convert",
    "converted_stages",
    "load",
    "load_model",
    "make_test_model",
    "retarget",
    "save",
    "set_backward",
]
__version__ = "0.1.0"
