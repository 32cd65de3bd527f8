"""Step 3, planning: takes a :class:`~autopipe.profiling.Profile`, devices and limits; gives a :class:`Plan`.

The planner answers *what is the fastest way to train this model on these devices within their
memory*: split points, micro-batch count, checkpoint mode and stages per device, exact for the
documented cost model (:mod:`.cost`), with the prediction recorded in the plan, and how many
replicas of that pipeline to train side by side (:mod:`.replicas`).  It needs no
torch: numpy, scipy and networkx only.
"""
from .compare import compare, format_comparison
from .plans import CHECKPOINT_MODES, PLAN_SCHEMA_VERSION, SCHEDULES, Plan, Prediction, StagePlan
from .simulate import Simulation, simulate, simulate_plan
from .replicas import plan
from .solver import PlanningError, build_plan

__all__ = [
    "CHECKPOINT_MODES", "PLAN_SCHEMA_VERSION", "SCHEDULES", "Plan", "PlanningError", "Prediction", "Simulation",
    "StagePlan", "build_plan", "compare", "format_comparison", "plan", "simulate", "simulate_plan",
]
