"""The evaluation report across PPO rounds: reward-hacking flag, best round, promotion gates.

Reward hacking (over-optimisation, Gao et al. 2022, "Scaling Laws for Reward Model
Overoptimization"): as the policy moves away from the reference, the proxy (learned reward
model) keeps rising while the gold score peaks and then falls. Between two consecutive
evaluations (the reference counts as round 0) we flag

    proxy_b - proxy_a > tol_proxy   and   gold_a - gold_b > tol_gold,
    tol = max(tolerance, sigmas * sqrt(se_a^2 + se_b^2))

`tolerance` is an absolute floor in each score's own units (the proxy is a normalised RM score,
the gold score e.g. VADER compound in [-1, 1]); the standard-error term keeps sampling noise of
two independent held-out evaluations from firing the flag (1 sigma by default: a warning sign,
not a significance test).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, Field

from ppo_core.eval.config import GateConfig
from ppo_core.eval.evaluate import PolicyEval

HACKING_TOLERANCE = 0.02
HACKING_SIGMAS = 1.0


class GateResult(BaseModel):
    """Outcome of `gate_result`."""

    passed: bool
    """True when every configured gate holds."""
    reasons: list[str] = Field(default_factory=list)
    """One line per failed gate, naming it and the numbers."""
    checked: list[str] = Field(default_factory=list)
    """One line per configured gate, passed or not."""


class HackingVerdict(BaseModel):
    """Outcome of `detect_reward_hacking`."""

    flag: bool
    """True when some consecutive pair of evaluations shows proxy up and gold down."""
    reason: str
    """Which rounds and by how much, or why nothing was flagged."""
    pairs: list[tuple[int | str, int | str]] = Field(default_factory=list)
    """(round_a, round_b) pairs that fired ("final" labels a final policy after the last round)."""


class EvalReport(BaseModel):
    """Evaluation of a PPO run on held-out prompts. Round 0 is the reference policy."""

    reference: PolicyEval
    """The reference policy's baseline (KL 0, win rate 0.5)."""
    rounds: dict[int, PolicyEval] = Field(default_factory=dict)
    """Per-round checkpoint evaluations, by round number (1, 2, ...)."""
    final: PolicyEval | None = None
    """The final policy (usually the last round's checkpoint)."""
    reward_hacking: bool = False
    """Proxy rose while gold fell between consecutive rounds (see module docstring)."""
    reward_hacking_reason: str = ""
    """Explanation of the flag."""
    best_round: int | None = None
    """Round with the highest gold reward (proxy when there is no gold scorer)."""
    gates: GateResult | None = None
    """Promotion gate results for the promoted policy (the final one when none passed), when
    gates were configured."""
    champion_round: int | None = None
    """The round promoted to champion; None when no candidate passed the gates or the final
    policy is not one of the evaluated rounds."""

    def history(self) -> dict[int, PolicyEval]:
        """Reference as round 0, then the rounds in order."""
        return {0: self.reference, **dict(sorted(self.rounds.items()))}


History = Mapping[int | str, PolicyEval] | Sequence[PolicyEval]
"""Evaluations in round order: a mapping label -> eval (kept in insertion order) or a sequence
(labelled 0, 1, ...)."""


def _as_history(history: History) -> list[tuple[int | str, PolicyEval]]:
    if isinstance(history, Mapping):
        return list(history.items())
    return list(enumerate(history))


def _threshold(se_a: float | None, se_b: float | None, tolerance: float, sigmas: float) -> float:
    noise = math.sqrt((se_a or 0.0) ** 2 + (se_b or 0.0) ** 2)
    return max(tolerance, sigmas * noise)


def detect_reward_hacking(
    history: History,
    tolerance: float = HACKING_TOLERANCE,
    sigmas: float = HACKING_SIGMAS,
) -> HackingVerdict:
    """Flag proxy-up / gold-down between consecutive evaluations. Without gold scores there is no independent judge, so nothing is flagged."""
    items = _as_history(history)
    if any(e.gold_reward is None for _, e in items):
        return HackingVerdict(
            flag=False, reason="no gold scorer: reward hacking cannot be detected"
        )
    fired, lines = [], []
    for (ra, a), (rb, b) in itertools.pairwise(items):
        d_proxy, d_gold = b.proxy_reward - a.proxy_reward, b.gold_reward - a.gold_reward  # type: ignore[operator]
        tol_proxy = _threshold(a.proxy_reward_se, b.proxy_reward_se, tolerance, sigmas)
        tol_gold = _threshold(a.gold_reward_se, b.gold_reward_se, tolerance, sigmas)
        if d_proxy > tol_proxy and -d_gold > tol_gold:
            fired.append((ra, rb))
            lines.append(
                f"round {ra} -> {rb}: proxy {d_proxy:+.3f} (> {tol_proxy:.3f}) while gold "
                f"{d_gold:+.3f} (< -{tol_gold:.3f})"
            )
    if not fired:
        return HackingVerdict(
            flag=False, reason="no round raised proxy while lowering gold beyond tolerance"
        )
    return HackingVerdict(flag=True, reason="; ".join(lines), pairs=fired)


def best_round(rounds: Mapping[int, PolicyEval]) -> int | None:
    """Round with the highest gold reward (proxy without gold); the earliest on ties."""
    if not rounds:
        return None
    use_gold = all(e.gold_reward is not None for e in rounds.values())

    def key(item: tuple[int, PolicyEval]) -> tuple[float, int]:
        value = item[1].gold_reward if use_gold else item[1].proxy_reward
        return (value, -item[0])  # type: ignore[return-value]

    return max(rounds.items(), key=key)[0]


def gate_result(
    evaluated: EvalReport | PolicyEval, reference: PolicyEval | None, gates: GateConfig
) -> GateResult:
    """Every configured gate must hold; each reason names the failed gate, and `checked` keeps
    one line per gate for the report. Given a report, its final policy (else its best round) is
    checked against its reference."""
    policy, reference = _gate_inputs(evaluated, reference)
    checked: list[str] = []
    reasons: list[str] = []

    def record(ok: bool, line: str) -> None:
        checked.append(("PASS " if ok else "FAIL ") + line)
        if not ok:
            reasons.append(line)

    for name, margin, value, base in (
        ("min_gold_margin", gates.min_gold_margin, policy.gold_reward, reference.gold_reward),
        ("min_proxy_margin", gates.min_proxy_margin, policy.proxy_reward, reference.proxy_reward),
    ):
        if margin is None:
            continue
        if value is None or base is None:
            record(False, f"{name}: no gold score to compare (configure a gold scorer)")
            continue
        diff = value - base
        record(
            diff >= margin,
            f"{name}: {value:.4f} - reference {base:.4f} = {diff:+.4f} vs required {margin:+.4f}",
        )
    if gates.max_kl is not None:
        kl = policy.kl(gates.kl_estimator)
        record(
            kl <= gates.max_kl,
            f"max_kl: {gates.kl_estimator} KL {kl:.4f} vs budget {gates.max_kl:.4f} nats",
        )
    return GateResult(passed=not reasons, reasons=reasons, checked=checked)


def _gate_inputs(
    evaluated: EvalReport | PolicyEval, reference: PolicyEval | None
) -> tuple[PolicyEval, PolicyEval]:
    if isinstance(evaluated, EvalReport):
        policy = evaluated.final
        if policy is None and evaluated.best_round is not None:
            policy = evaluated.rounds[evaluated.best_round]
        if policy is None:
            raise ValueError("the report has neither a final policy nor any round to gate")
        return policy, reference or evaluated.reference
    if reference is None:
        raise ValueError("gate_result needs the reference's PolicyEval to compute margins")
    return evaluated, reference


def build_report(
    reference: PolicyEval,
    rounds: Mapping[int, PolicyEval],
    final: PolicyEval | None = None,
    gates: GateConfig | None = None,
    tolerance: float = HACKING_TOLERANCE,
    sigmas: float = HACKING_SIGMAS,
) -> EvalReport:
    """Assemble the report: hacking flag over reference -> rounds (-> final when it is not already
    the last round), best round, and gates on the final policy (else the best round)."""
    ordered = dict(sorted(rounds.items()))
    if 0 in ordered:
        raise ValueError("round 0 is the reference; number PPO rounds from 1")
    history: dict[int | str, PolicyEval] = {0: reference, **ordered}
    if final is not None and (not ordered or final != list(ordered.values())[-1]):
        history["final"] = final
    verdict = detect_reward_hacking(history, tolerance, sigmas)
    report = EvalReport(
        reference=reference,
        rounds=ordered,
        final=final,
        reward_hacking=verdict.flag,
        reward_hacking_reason=verdict.reason,
        best_round=best_round(ordered),
    )
    if gates is not None:
        report.champion_round, report.gates = choose_champion(report, gates)
    else:
        report.champion_round = _final_round(report)
    return report


def choose_champion(report: EvalReport, gates: GateConfig) -> tuple[int | None, GateResult]:
    """(promoted round or None, the gate result it was decided by); see GateConfig.promote."""
    if gates.promote == "best_round":
        results = {k: gate_result(e, report.reference, gates) for k, e in report.rounds.items()}
        chosen = best_round({k: e for k, e in report.rounds.items() if results[k].passed})
        if chosen is not None:
            return chosen, results[chosen]
    result = gate_result(report, report.reference, gates)
    return (_final_round(report) if result.passed else None), result


def _final_round(report: EvalReport) -> int | None:
    """The round number of the policy the gates check by default (the final one)."""
    if report.final is None:
        return report.best_round
    matches = [k for k, e in report.rounds.items() if e == report.final]
    return matches[-1] if matches else None
