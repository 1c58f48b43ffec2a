"""Estimate -> a table for people or JSON for programs."""

from __future__ import annotations

import json

from torchtitan.estimation.estimate import Estimate
from torchtitan.estimation.tracker import ROWS

GIB = 2**30


def to_dict(est: Estimate) -> dict:
    return {
        "world_size": est.world_size,
        "layout": est.layout,
        "vocab_source": est.vocab_source,
        "params": est.params,
        "seconds": round(est.seconds, 2),
        "peak_bytes": est.peak,
        "warnings": est.warnings,
        "optimizer_groups": est.optimizer_groups,
        "roles": [
            {
                "role": r.role,
                "rank": r.rank,
                "peak_bytes": r.memory.peak,
                "peak_phase": r.memory.peak_phase,
                "phase_peaks_bytes": {name: phase.total for name, phase in r.memory.phases.items()},
                "breakdown_bytes": r.memory.breakdown,
                "notes": r.memory.notes,
            }
            for r in est.roles
        ],
    }


def to_json(est: Estimate) -> str:
    return json.dumps(to_dict(est), indent=2)


def format_table(est: Estimate, title: str) -> str:
    layout = " ".join(f"{k}={v}" for k, v in est.layout.items())
    out = [
        f"{title}: {est.params:,} parameters; world_size {est.world_size} ({layout}); vocabulary: {est.vocab_source}"
    ]
    roles = est.roles
    # each column as wide as its widest cell, and two spaces apart ("forward/backward" fills 16 characters)
    widths = [2 + max(10, len(r.role), len(r.memory.peak_phase)) for r in roles]

    def line(label: str, cells: list[str]) -> str:
        return f"{label:<26}" + "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths))

    out.append(line("GiB per rank at the peak", [r.role for r in roles]))
    modeled = [row for r in roles for row in r.memory.breakdown if row not in ROWS]
    for row in [*ROWS, *dict.fromkeys(modeled)]:
        if any(row in r.memory.breakdown for r in roles):
            out.append(line(f"  {row}", [f"{r.memory.breakdown.get(row, 0) / GIB:.2f}" for r in roles]))
    out.append(line("peak", [f"{r.memory.peak / GIB:.2f}" for r in roles]))
    out.append(line("peak falls in", [r.memory.peak_phase for r in roles]))
    for name in dict.fromkeys(n for r in roles for n in r.memory.phases):  # a step's own phases (RL's generation)
        out.append(line(f"peak of {name}", [f"{r.memory.phases[name].total / GIB:.2f}" for r in roles]))
    for r in roles:
        out += [f"note ({r.role}): {n}" for n in r.memory.notes]
    if len(est.optimizer_groups) > 1 or any(g["optimizer"] == "Muon" for g in est.optimizer_groups):
        out.append("optimizer state by param group (whole model, before sharding; included in the rows above):")
        for g in est.optimizer_groups:
            out.append(
                f"  {g['optimizer']:<6} {g['params']:>14,} params x {g['states_per_param']} states = "
                f"{g['state_bytes'] / GIB:.3f} GiB  (weight_decay {g['weight_decay']:g}; {g['rule']})"
            )
    out += [f"warning: {w}" for w in est.warnings]
    out.append(f"estimated in {est.seconds:.1f} s (fake tensors, one simulated rank per role)")
    return "\n".join(out)
