"""The precision map a run reports: the whole model's, on every host and every rank.

What tracking logs (`precision/flops_share/<format>`, `precision_map.json`), what
summary.json and the progress line show, and what decides whether an eval checkpoint runs
an `eval_hp` pass all read one object with `formats()` (fqn -> format name) and
`flops_share()` (GEMM FLOP share per format). `tracked_map` chooses it, by one rule for
`lowprec run` (`lowprec.runtime.trainer.parallel_run`) and for a framework's loop
(`lowprec.integrations.core.HostedRollout`):

* one rank holds every site (one process, data or tensor parallel): the rank's own
  PrecisionState;
* pipeline stages with a controller: the controller's record (`StagedPrecisionMap`), which
  covers every stage and is the same on every rank, since every rank decides alike;
* pipeline stages without a controller: `GatheredPrecisionMap`, each rank's own sites'
  formats gathered from every rank (one `all_gather_object`) where they change: when the map
  is built and after formats are loaded from a checkpoint (`regather`). Nothing else changes
  a format without a controller, so a step costs nothing. The whole model's PrecisionState
  gives the site names (those a single process has) and the FLOPs; its copies of the other
  stages' layers are not what those stages run (a rank loads only its own stage's formats
  from a checkpoint), so their formats are never read.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["PrecisionMap", "GatheredPrecisionMap", "tracked_map", "regather"]


class PrecisionMap(Protocol):
    """What a run reports as the model's precision: a PrecisionState has both."""

    def formats(self) -> dict[str, str]: ...

    def flops_share(self) -> dict[str, float]: ...


class GatheredPrecisionMap:
    """The whole model's precision map under pipeline stages without a controller: every
    rank's `local` sites' formats, gathered over `group` (None: every rank) into the order and
    names of `whole` (the whole model's PrecisionState). `gather` is a collective: every rank
    of `group` calls it, at the same point (it runs once when built)."""

    def __init__(self, whole, local, group=None):
        self.whole, self.local, self.group = whole, local, group
        self._formats: dict[str, str] = {}
        self.gather()

    def gather(self) -> None:
        """Read every rank's sites' formats now (after they changed on some rank)."""
        from lowprec.state.ranks import from_every_rank
        held = {fqn: fmt for part in from_every_rank(self.local.formats(), self.group) for fqn, fmt in part.items()}
        missing = [fqn for fqn in self.whole.sites if fqn not in held]
        if missing:
            raise ValueError(f"{len(missing)} of the model's {len(self.whole.sites)} sites are held by no rank "
                             f"(e.g. {', '.join(missing[:3])}): every site must be in some rank's pipeline stage")
        self._formats = {fqn: held[fqn] for fqn in self.whole.sites}

    def formats(self) -> dict[str, str]:
        return dict(self._formats)

    def flops_share(self) -> dict[str, float]:
        return self.whole.flops_share(self._formats)


def tracked_map(local, whole=None, controller=None, group=None) -> PrecisionMap:
    """The map a host reports (see the module docstring). local: this rank's PrecisionState;
    whole: the whole model's, when `local` holds one pipeline rank's sites (None otherwise);
    controller: the run's RolloutController, or None; group: the ranks that together hold every
    site (None: every rank). Without a controller under stages, a collective (every rank calls it)."""
    if whole is None:
        return local
    if controller is not None:
        from lowprec.sites.precision_state import StagedPrecisionMap
        return StagedPrecisionMap(whole, lambda: controller.current)
    return GatheredPrecisionMap(whole, local, group)


def regather(tracked: PrecisionMap) -> None:
    """After every rank loaded its sites' formats from a checkpoint: a gathered map reads them
    again (a collective for it, every rank calls this); any other map reads live formats."""
    if isinstance(tracked, GatheredPrecisionMap):
        tracked.gather()
