"""Exit statistics: where tokens left the model, for prefill and decode separately, as text and PNG."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class PhaseStats:
    """Exit layers of the tokens of one phase (prefill or decode); `num_layers` means no exit.

    A step's decisions are kept as they are and counted when a figure is first read: counting them costs no
    tensor work per step, and never waits for the device (no host sync per forward).
    """

    num_layers: int
    _exits: torch.Tensor | None = field(default=None, repr=False)  # (num_layers + 1,) tokens per exit layer
    _executed: torch.Tensor | None = field(default=None, repr=False)  # (num_layers + 1,) tokens per layers run
    # kv="recompute": layer runs made up in this phase for positions earlier steps parked (rows x positions, padding
    # and finished rows included: the work the forwards did, beyond each step's own depth)
    recomputed: int = 0
    _pending: list = field(default_factory=list, repr=False)  # (exit layers, executed, keep) not counted yet

    def add(self, exit_layers: torch.Tensor, executed: int | torch.Tensor, keep: torch.Tensor | None = None,
            recomputed: int = 0) -> None:
        """Count the per-token exit layers `exit_layers` where `keep` (default: all), each token having run
        `executed` layers (one number, or one per token), and `recomputed` layer runs made up for earlier tokens.
        Kept until a figure is read (`_count`)."""
        self.recomputed += recomputed
        self._pending.append((exit_layers, executed, keep))

    def _count(self) -> None:
        """Fold the steps kept by `add` into the per-layer counts, on the device their decisions live on."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        device = pending[0][0].device if self._exits is None else self._exits.device
        layers, executed, weights = [], [], []
        for exit_layers, ran, keep in pending:
            flat = exit_layers.reshape(-1).to(device)
            layers.append(flat)
            executed.append(ran.reshape(-1).to(device) if isinstance(ran, torch.Tensor) else torch.full_like(flat, ran))
            weights.append(torch.ones_like(flat) if keep is None else keep.reshape(-1).to(device, torch.long))
        if self._exits is None:
            self._exits = torch.zeros(self.num_layers + 1, dtype=torch.long, device=device)
            self._executed = torch.zeros_like(self._exits)
        weight = torch.cat(weights)
        self._exits.scatter_add_(0, torch.cat(layers), weight)
        self._executed.scatter_add_(0, torch.cat(executed).to(torch.long), weight)

    def merge(self, other: PhaseStats) -> None:
        """Add the counts of `other` (same model) to these."""
        self._pending.extend(other._pending)
        self.recomputed += other.recomputed
        if other._exits is None:
            return
        self._count()
        if self._exits is None:
            self._exits, self._executed = other._exits.clone(), other._executed.clone()
            return
        self._exits += other._exits.to(self._exits.device)
        self._executed += other._executed.to(self._executed.device)

    @property
    def exits(self) -> Counter:
        """layer -> tokens that left after it (read from the device)."""
        self._count()
        return _counter(self._exits)

    @property
    def executed(self) -> Counter:
        """layers really run -> tokens (read from the device)."""
        self._count()
        return _counter(self._executed)

    @property
    def tokens(self) -> int:
        return sum(self.exits.values())

    @property
    def exit_rate(self) -> float:
        """Fraction of tokens that exited before the last layer."""
        return 1.0 - self.exits.get(self.num_layers, 0) / self.tokens if self.tokens else 0.0

    @property
    def mean_layers(self) -> float:
        """Mean depth a token's output came from."""
        return sum(k * c for k, c in self.exits.items()) / self.tokens if self.tokens else float(self.num_layers)

    @property
    def mean_executed(self) -> float:
        """Mean number of layers the forward of a token's own step ran (below `num_layers` only in skip mode;
        what sets a decode step's time). Under kv="recompute" the layers a token skipped still run, later,
        batched into a later step (`recomputed`): its compute per token stays the full depth."""
        total = sum(self.executed.values())
        return sum(k * c for k, c in self.executed.items()) / total if total else float(self.num_layers)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "exit_rate": self.exit_rate, "mean_layers": self.mean_layers,
                "mean_executed": self.mean_executed, "recomputed": self.recomputed,
                "exits": {int(k): int(v) for k, v in sorted(self.exits.items())}}


def pricing_line(record: dict) -> str:
    """What pricing decided, in words (`ExitStats.pricing`)."""
    if "costs" not in record:
        return record.get("note", "did not run")
    costs = record["costs"]
    saves = ", ".join(f"L{k} {v:.1f} ms" for k, v in costs["exit_saves_ms"].items())
    closed = ", ".join(f"L{k}" for k in record["closed"]) or "none"
    return (f"closed {closed} (an exit saves {saves}; scoring a checkpoint costs {costs['score_ms']:.2f} ms, "
            f"a plain step {costs['plain_step_ms']:.1f} ms)")


def aside_line(report: dict) -> str:
    """Step aside's counters, in words (`ExitStats.aside`)."""
    probe = report["last_probe_ms"]
    timed = "" if probe is None else \
        f"; last probe: TIDE steps {probe['tide_step']:.1f} ms, plain {probe['plain_step']:.1f} ms"
    return (f"stepped aside {report['stepped_aside']} time(s) in {report['probes']} probe(s); "
            f"{report['plain_steps']} of {report['plain_steps'] + report['tide_steps']} timed decode steps ran plain"
            f"{timed}; {report['priced_plain']} step(s) too wide for an exit to pay ran plain")


def _counter(counts: torch.Tensor | None) -> Counter:
    return Counter() if counts is None else Counter({k: v for k, v in enumerate(counts.tolist()) if v})


@dataclass
class ExitStats:
    """What one generate call did, per phase: `handle.last_stats` or `tide_hf.last_stats()`.

    Args:
        num_layers: the model's decoder layers.
        checkpoints: the router's checkpoint layers.
        prefill: the prompt's positions (`PhaseStats`: exits per layer, `exit_rate`, `mean_layers`,
            `mean_executed`, `recomputed`).
        decode: the generated tokens, likewise.
        speculative: speculative mode's counters (drafted, accepted, rounds, fallback), else None.
        mode: the mode that served the call ("select", "skip" or "speculative").
        reason: why that mode served it (attach's default or the mode asked for).
        pricing: skip mode at a quality target: the checkpoints pricing closed ("closed"), the costs it measured
            ("costs", milliseconds) and each open checkpoint's value before ("value_ms_per_token"); None where
            pricing did not run.
        aside: priced skip mode on the CPU: decode steps run with TIDE and plain, probes, times TIDE stepped aside
            and the last probe's mean step times (`runtime/aside.py`); None elsewhere.

    Example:
        >>> handle = tide_hf.attach(model, router)  # doctest: +SKIP
        >>> model.generate(**inputs, max_new_tokens=20)  # doctest: +SKIP
        >>> print(handle.last_stats.summary())  # doctest: +SKIP
    """

    num_layers: int
    checkpoints: list[int]
    prefill: PhaseStats = None  # type: ignore[assignment]
    decode: PhaseStats = None  # type: ignore[assignment]
    speculative: dict | None = None  # speculative mode: drafting counters of the call
    mode: str = "select"
    reason: str = "asked for"
    pricing: dict | None = None
    aside: dict | None = None

    def __post_init__(self) -> None:
        self.prefill = self.prefill or PhaseStats(self.num_layers)
        self.decode = self.decode or PhaseStats(self.num_layers)

    def as_dict(self) -> dict:
        return {"num_layers": self.num_layers, "checkpoints": self.checkpoints, "mode": self.mode,
                "reason": self.reason, **({"pricing": self.pricing} if self.pricing is not None else {}),
                **({"aside": self.aside} if self.aside is not None else {}),
                "prefill": self.prefill.as_dict(), "decode": self.decode.as_dict(),
                **({"speculative": self.speculative} if self.speculative is not None else {})}

    def summary(self) -> str:
        """A few lines a person can read: the mode and why, exit rate and mean depth per phase, exits per
        checkpoint."""
        lines = [f"mode    {self.mode}: {self.reason}"]
        if self.pricing is not None:
            lines.append(f"pricing {pricing_line(self.pricing)}")
        if self.aside is not None:
            lines.append(f"aside   {aside_line(self.aside)}")
        for name, phase in (("prefill", self.prefill), ("decode", self.decode)):
            per_layer = ", ".join(f"L{k}: {phase.exits.get(k, 0)}" for k in self.checkpoints)
            lines.append(
                f"{name:7s} {phase.tokens:6d} tokens  exit rate {phase.exit_rate:6.1%}  "
                f"mean layers {phase.mean_layers:5.2f}/{self.num_layers}  executed {phase.mean_executed:5.2f}"
                + (f" (+{phase.recomputed} layer runs caught up)" if phase.recomputed else "")
                + f"  exits [{per_layer}]"
            )
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """Draw the per-layer exit histogram (prefill and decode side by side) to the PNG file `path` (a `.png`
        name in an existing folder; returned as written)."""
        from ..plotting import png_path, pyplot, save_png

        path = png_path(path)  # refused before matplotlib draws anything
        plt = pyplot()

        layers = [*self.checkpoints, self.num_layers]
        labels = [str(k) for k in self.checkpoints] + [f"{self.num_layers}\n(no exit)"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
        for ax, (name, phase) in zip(axes, (("prefill", self.prefill), ("decode", self.decode))):
            total = max(phase.tokens, 1)
            ax.bar(labels, [100 * phase.exits.get(k, 0) / total for k in layers], color="#3b7dd8")
            ax.set_title(f"{name}: {phase.tokens} tokens, mean {phase.mean_layers:.1f} layers")
            ax.set_xlabel("exit after layer")
        axes[0].set_ylabel("% of tokens")
        return save_png(fig, path)
