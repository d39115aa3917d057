"""A GPU's roofline ceilings (peak FLOP/s, HBM bandwidth) and those of the simulated GPU.

The tuner measures ceilings on a GPU and falls back to the simulated ones; the runtime's request
cost model (``energy/request_cost.py``) splits a step's energy by the simulated ones. Both read
them from here, so the runtime never imports the tuner (docs/design.md, "Layering").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .gpu import H200, GpuSpec, StepWork, simulate_step

__all__ = ["Ceilings", "simulated_ceilings"]


@dataclass
class Ceilings:
    """Peak dense bf16 FLOP/s and HBM bandwidth (B/s) of the GPU, and where they come from."""

    peak_flops: float
    mem_bw: float
    source: str

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/B) above which work is compute-bound."""
        return self.peak_flops / self.mem_bw


def simulated_ceilings(spec: GpuSpec = H200) -> Ceilings:
    """The simulated GPU's effective ceilings at the driver-default clock (power cap applied). Simulated."""
    big = simulate_step(dataclasses.replace(spec, t_fixed_s=0.0), StepWork(flops=1e15, bytes=1e9), spec.f_max_mhz)
    copy = simulate_step(dataclasses.replace(spec, t_fixed_s=0.0), StepWork(flops=0.0, bytes=1e11), spec.f_max_mhz)
    return Ceilings(
        peak_flops=1e15 / big.time_s,
        mem_bw=1e11 / copy.time_s,
        source=f"simulated ({spec.name}, vllm_powersave/sim/gpu.py; calibrated on the H200's measured 661 TFLOP/s and 4.28 TB/s)",
    )
