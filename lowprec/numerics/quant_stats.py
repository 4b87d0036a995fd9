"""The quantization statistics of one operand: one packed vector, read on the host only when asked.

`QuantStats` holds amax, the saturated and underflow counts, the squared error, the signal
power, the non-finite and element counts and the underflow energy as one float64 tensor on
the operand's device, so a check step collects every site's statistics without a host sync.
`lowprec.numerics.quantize` computes them in the quantization pass; the monitors read them.
"""

from __future__ import annotations

import math

import torch

__all__ = ["QuantStats", "sqnr_db"]


def sqnr_db(signal: float, error: float) -> float:
    """10 log10(signal / error): +inf for no error (or no signal), -inf for an error that
    overflowed to inf against a finite signal, NaN where both are inf (no answer)."""
    if not error > 0 or not signal > 0:
        return math.inf if error == 0 or signal == 0 else math.nan
    ratio = signal / error
    if ratio == 0.0:
        return -math.inf
    return 10 * math.log10(ratio) if math.isfinite(ratio) else (math.nan if ratio != ratio else math.inf)


class QuantStats:
    """Quantization statistics of one operand, packed in one float64 tensor (no host sync)."""

    FIELDS = ("amax", "saturated", "underflow", "sq_error", "signal_power", "nonfinite", "numel",
              "underflow_energy")

    def __init__(self, packed: torch.Tensor):
        if packed.shape != (len(self.FIELDS),):
            raise ValueError(f"QuantStats expects a vector of {len(self.FIELDS)}, got {tuple(packed.shape)}")
        self.packed = packed

    def __getattr__(self, name: str) -> torch.Tensor:
        fields = type(self).FIELDS
        if name in fields:
            return self.packed[fields.index(name)]
        raise AttributeError(name)

    def to_dict(self) -> dict[str, float]:
        """Host values (this syncs), plus derived fractions and SQNR in dB."""
        v = dict(zip(self.FIELDS, self.packed.tolist()))
        n = max(v["numel"], 1.0)
        v["saturated_frac"] = v["saturated"] / n
        v["underflow_frac"] = v["underflow"] / n
        v["underflow_energy_frac"] = v["underflow_energy"] / v["signal_power"] if v["signal_power"] > 0 else 0.0
        v["rel_mse"] = v["sq_error"] / v["signal_power"] if v["signal_power"] > 0 else 0.0
        v["sqnr_db"] = sqnr_db(v["signal_power"], v["sq_error"])
        return v

    def __repr__(self) -> str:
        return f"QuantStats({', '.join(f'{k}={x:.4g}' for k, x in zip(self.FIELDS, self.packed.tolist()))})"
