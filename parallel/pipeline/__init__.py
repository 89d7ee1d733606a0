"""Pipeline parallelism: schedules as data, their simulation and pictures of them.

``schedule(name, pp, rank, m, v)`` gives one rank's list of ``Action``s (F / B / W compute
and SEND / RECV of activations and gradients); ``simulate`` runs all ranks' lists as a
discrete-event model; ``timeline_png`` / ``chrome_trace`` draw simulated or measured events.
"""

from parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    check_consistent,
    schedule,
    splits_backward,
    stage_of,
    validate,
)
from parallel.pipeline.simulate import SimResult, simulate
from parallel.pipeline.timeline import chrome_trace, timeline_png

__all__ = [
    "SCHEDULES",
    "Action",
    "SimResult",
    "check_consistent",
    "chrome_trace",
    "schedule",
    "simulate",
    "splits_backward",
    "stage_of",
    "timeline_png",
    "validate",
]
