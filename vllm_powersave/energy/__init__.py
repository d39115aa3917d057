"""Energy measurement: meters (NVML measured, simulated) and per-phase attribution."""

from .account import PhaseEnergyAccount
from .meters import EnergyMeter, NvmlEnergyMeter, SimulatedEnergyMeter

__all__ = ["EnergyMeter", "NvmlEnergyMeter", "PhaseEnergyAccount", "SimulatedEnergyMeter"]
