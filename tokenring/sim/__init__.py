"""Cost model: topologies, kernel-time model and a simulator that runs the executor's schedules on them.

from tokenring.sim import get_topology, simulate, shapes_for
r = simulate("token_ring", shapes_for(S=24000, P=4, H=32), get_topology("a10-pcie-4"))
r.time, r.regime, [s.time for s in r.passes[0].steps]
"""

from .kernel_model import DEVICES, KernelModel, calibrate_cpu, kernel_model
from .simulator import SimResult, candidates, compile_schedule, shapes_for, simulate
from .topology import PRESETS, Topology, get_topology, parse_rate

__all__ = [
    "simulate",
    "shapes_for",
    "candidates",
    "compile_schedule",
    "SimResult",
    "get_topology",
    "Topology",
    "PRESETS",
    "parse_rate",
    "kernel_model",
    "calibrate_cpu",
    "KernelModel",
    "DEVICES",
]
