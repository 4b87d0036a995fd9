"""How the rollout controller moves sites along their ladders: a fallback one rung up (and
quarantine after repeated failures), the rollback of the newest stage, and the promotion of
the next stage (held by the LR probe or the gate). Every move changes the controller's
`current` formats, appends its `Event` to the decision and records when formats last
changed. A mixin of `lowprec.policy.controller.RolloutController`, whose state it reads."""

from __future__ import annotations

from lowprec.numerics.formats import Format, get_format
from lowprec.policy.decisions import Decision
from lowprec.policy.detectors import lr_sensitivity_hold
from lowprec.policy.events import Event, EventKind
from lowprec.policy.verdicts import Verdict

__all__ = ["LadderMoves"]


def _bits(fmt: Format | str) -> int:
    """The format's bit width; the controller's state and decisions name formats, its ladders hold them."""
    return get_format(fmt).bits


def _high(fmt: Format | str) -> bool:
    return get_format(fmt).is_high_precision


class LadderMoves:
    """Fallback, rollback and promotion over the controller's ladders (module docstring)."""

    def _ladder_text(self, site: str) -> str:
        return " -> ".join(f.name for f in self.ladders[site])

    def _up(self, site: str) -> str | None:
        """The name of the next format up the ladder (higher precision), or None at the top."""
        cur_bits = _bits(self.current[site])
        for f in self.ladders[site]:
            if f.bits > cur_bits:
                return f.name
        return None

    def _move(self, sites: list[str], to: dict[str, str], kind: str, step: int, reason: str,
              evidence: dict, decision: Decision, stage: str | None = None) -> None:
        moved = [s for s in sites if to.get(s) and to[s] != self.current[s]]
        if not moved:
            return
        frm = {s: self.current[s] for s in moved}
        for s in moved:
            self.current[s] = to[s]
            decision.changes[s] = to[s]
        self.formats_changed_at = step        # the new formats train from step + 1
        decision.events.append(Event(step, kind, tuple(moved), frm, {s: to[s] for s in moved}, reason,
                                     evidence, stage))

    def _fallback(self, site: str, step: int, reason: str, evidence: dict, decision: Decision) -> None:
        up = self._up(site)
        if up is None:
            return
        self._move([site], {site: up}, EventKind.FALLBACK, step, reason, evidence, decision,
                   self.stage_of.get(site))
        self.failures[site] = self.failures.get(site, 0) + 1
        self.strikes[site] = 0
        if self.failures[site] >= self.config.quarantine_after and site not in self.floor:
            self.floor[site] = up
            self.retry_at.pop(site, None)
            decision.events.append(Event(step, EventKind.QUARANTINE, (site,), {}, {}, (
                f"failed {self.failures[site]} times; stays at {up} or above for the rest of the run"),
                {"failures": self.failures[site]}, self.stage_of.get(site)))
        elif site not in self.floor:
            self.retry_at[site] = step + self.config.cooldown_steps

    def _rollback_newest(self, step: int, reason: str, evidence: dict, decision: Decision) -> bool:
        if self.promoted == 0:
            return False
        stage = self.stages[self.promoted - 1]
        self.promoted -= 1
        to = {}
        for s in stage.sites:
            if self.stage_of.get(s) == stage.name:
                before = self.before_stage.pop(s, self.current[s])
                if _bits(before) > _bits(self.current[s]):
                    to[s] = before
                self.stage_of.pop(s, None)
                self.target.pop(s, None)
                self.retry_at.pop(s, None)
        self._move(list(stage.sites), to, EventKind.ROLLBACK, step, reason, evidence, decision, stage.name)
        self.stage_failures[stage.name] = self.stage_failures.get(stage.name, 0) + 1
        if self.stage_failures[stage.name] >= self.config.quarantine_after:
            held = [s for s in stage.sites if s not in self.floor]
            for s in held:
                self.floor[s] = self.current[s]
            if held:
                decision.events.append(Event(step, EventKind.QUARANTINE, tuple(held), {}, {}, (
                    f"stage {stage.name} rolled back {self.stage_failures[stage.name]} times; its sites "
                    f"stay at their current formats"), {"rollbacks": self.stage_failures[stage.name]},
                    stage.name))
        return True

    def _promote(self, step: int, d: Decision, gate=None) -> None:
        stage = self.stages[self.promoted]
        held, ev = lr_sensitivity_hold(self.lr_history, self.config.lr_hold_rise, self.config.lr_hold_above)
        if held:   # hold, as an inconclusive gate does: asked again after another min_steps
            d.events.append(Event(step, EventKind.HOLD, (), {}, {}, (
                f"promotion of {stage.name} held: LR sensitivity {ev['lr_sensitivity']:.4g} (probe at step "
                f"{ev['probe_step']}) is above its hold level {ev['hold_level']:.4g}"), ev, stage.name))
            return
        if gate is not None:
            verdict = self._gate_event(step, gate(step), f"before {stage.name}", stage.name, d)
            if verdict is Verdict.REGRESS:
                self._rollback_newest(step, "evaluation gate regressed", {"verdict": verdict.value}, d)
                return
            if verdict is not Verdict.PASS:
                return  # inconclusive: hold, ask again after another min_steps
        self.promoted += 1
        to = {}
        for s in stage.sites:
            fmt = stage.format
            if s in self.floor and _bits(fmt) < _bits(self.floor[s]):
                fmt = self.floor[s]
            if self.failures.get(s) and s not in self.floor and _bits(fmt) < _bits(self.current[s]):
                # it fell back before: it comes down again only through its own retry, after
                # its cooldown (a promotion is no back door around a cooldown, and sites that
                # failed are retried one by one, not all at once with a whole stage)
                self.retry_at.setdefault(s, step + self.config.cooldown_steps)
                self.stage_of[s], self.target[s] = stage.name, fmt
                continue
            if _bits(fmt) < _bits(self.current[s]):
                to[s] = fmt
                self.before_stage[s] = self.current[s]
            self.stage_of[s] = stage.name
            self.target[s] = fmt
        self._move(list(stage.sites), to, EventKind.PROMOTE, step, f"stable for {step - self.stable_since} "
                   f"steps", {"min_steps": self.config.min_steps}, d, stage.name)
