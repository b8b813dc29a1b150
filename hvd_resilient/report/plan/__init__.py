"""`hvd-resilient plan`: what a job of N hosts x G workers keeps of its time over weeks.

A discrete-event simulation of failures (per class, as Poisson processes whose rates default to
published fleet data), the recovery each strategy takes for each class (costs measured from a
run folder's event log, or from this project's benchmarks), and the commit and durable
checkpoint cadence (searched for the one that maximizes the effective training time ratio).

Layers: `model` (every input, its default and where that number comes from), `calibrate`
(measured inputs from an event log and from `bench/results/checkpoint.json`), `strategies`
(the recovery path each strategy takes for each failure class), `simulate` (the simulation and
the interval search), `render` (text, JSON-ready dicts, the plot) and `cli` (the command).
Unlike the rest of `report/` this package needs numpy (a core dependency): a 100k-GPU month
simulated over 20 seeds and a grid of intervals has to take seconds, not minutes.
"""

from hvd_resilient.report.plan.model import CLASSES, Inputs, Job
from hvd_resilient.report.plan.simulate import Plan, plan, simulate

__all__ = ["CLASSES", "Inputs", "Job", "Plan", "plan", "simulate"]
