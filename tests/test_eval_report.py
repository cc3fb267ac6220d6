"""The evaluation report from constructed evaluations: reward-hacking flag, best round, gates,
champion promotion, plots. (Evaluations on tiny models are in test_evaluation.py.)"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from pydantic import ValidationError

from ppo_core.eval.config import GateConfig
from ppo_core.eval.evaluate import EvalSample, PolicyEval
from ppo_core.eval.markdown import report_markdown
from ppo_core.eval.plots import plot_overoptimisation, plot_training_curves
from ppo_core.eval.report import (
    EvalReport,
    best_round,
    build_report,
    detect_reward_hacking,
    gate_result,
)


# ---- report: hacking flag, best round, gates ------------------------------------------------
def ev(proxy: float, gold: float | None, kl: float = 0.0, se: float = 0.0) -> PolicyEval:
    """A constructed evaluation; k1 and k3 are set 10% above and below the exact KL."""
    return PolicyEval(
        n=100,
        kl_exact=kl,
        kl_k1=kl * 1.1,
        kl_k3=kl * 0.9,
        proxy_reward=proxy,
        proxy_reward_se=se,
        gold_reward=gold,
        gold_reward_se=None if gold is None else se,
        response_length=10.0,
        eos_rate=1.0,
    )


def test_hacking_flag_fires_on_proxy_up_gold_down_only() -> None:
    hacked = detect_reward_hacking({0: ev(0.0, 0.1), 1: ev(0.5, 0.3, 1.0), 2: ev(1.0, 0.1, 4.0)})
    assert hacked.flag and hacked.pairs == [(1, 2)] and "round 1 -> 2" in hacked.reason
    assert not detect_reward_hacking([ev(0.0, 0.1), ev(0.5, 0.3), ev(1.0, 0.4)]).flag  # both up
    assert not detect_reward_hacking([ev(0.0, 0.3), ev(-0.2, 0.1)]).flag  # both down: not hacking
    # gold dips within the absolute tolerance (0.02): noise, not hacking
    assert not detect_reward_hacking([ev(0.0, 0.30), ev(0.5, 0.29)]).flag
    # a 0.1 dip is flagged when the evaluations are exact, not when each has a 0.1 standard error
    assert detect_reward_hacking([ev(0.0, 0.3), ev(0.5, 0.2)]).flag
    assert not detect_reward_hacking([ev(0.0, 0.3, se=0.1), ev(0.5, 0.2, se=0.1)]).flag
    assert not detect_reward_hacking([ev(0.0, None), ev(1.0, None)]).flag  # no judge, no verdict


def test_report_names_best_round_and_flags_hacking_after_the_gold_peak() -> None:
    rounds = {1: ev(0.5, 0.3, 1.0), 2: ev(0.8, 0.45, 2.0), 3: ev(1.2, 0.2, 5.0)}
    report = build_report(ev(0.0, 0.1), rounds, final=rounds[3])
    assert report.best_round == 2 and report.reward_hacking
    assert "2 -> 3" in report.reward_hacking_reason
    # the int round keys survive a JSON round trip (JSON object keys are strings)
    assert EvalReport.model_validate_json(report.model_dump_json()) == report
    no_gold = {1: ev(0.5, None), 2: ev(0.3, None)}
    assert best_round(no_gold) == 1  # by proxy when there is no gold scorer
    assert build_report(ev(0.0, 0.1), {1: ev(0.5, 0.3)}).best_round == 1


def test_gates_pass_and_fail_with_reasons_naming_the_gate() -> None:
    reference, policy = ev(0.0, 0.10), ev(0.8, 0.40, kl=5.0)
    result = gate_result(
        policy, reference, GateConfig(min_gold_margin=0.25, min_proxy_margin=0.5, max_kl=6.0)
    )
    assert result.passed and result.reasons == []
    result = gate_result(policy, reference, GateConfig(min_gold_margin=0.35, max_kl=6.0))
    assert not result.passed and len(result.reasons) == 1
    assert result.reasons[0].startswith("min_gold_margin")
    # exact KL 5.0, k3 4.5, k1 5.5: the budget applies to the configured estimator
    result = gate_result(policy, reference, GateConfig(max_kl=4.8, kl_estimator="k3"))
    assert result.passed
    result = gate_result(policy, reference, GateConfig(max_kl=4.8, kl_estimator="k1"))
    assert not result.passed and result.reasons[0].startswith("max_kl") and "k1" in result.reasons[0]
    result = gate_result(
        ev(0.8, None), ev(0.0, None), GateConfig(min_gold_margin=0.1, min_proxy_margin=1.0)
    )
    assert not result.passed
    assert [r.split(":")[0] for r in result.reasons] == ["min_gold_margin", "min_proxy_margin"]
    report = build_report(reference, {1: policy}, final=policy, gates=GateConfig(max_kl=1.0))
    assert report.gates is not None and not report.gates.passed
    result = gate_result(report, None, GateConfig(max_kl=6.0))
    assert (result.passed, result.reasons) == (True, [])
    with pytest.raises(ValidationError):
        GateConfig(max_kl=1.0, min_gold=0.2)  # unknown key: a typo in the config fails loudly


def test_best_round_promotion_picks_the_best_round_inside_the_gates() -> None:
    reference = ev(0.0, 0.30)
    shown = [EvalSample(prompt="p", response="round one's answer", proxy=0.5)]
    first = ev(0.5, 0.55, kl=4.9).model_copy(update={"samples": shown})
    rounds = {1: first, 2: ev(0.9, 0.68, kl=6.3), 3: ev(1.2, 0.52, kl=5.5)}
    final_only = GateConfig(max_kl=6.0, min_gold_margin=0.1)
    best = final_only.model_copy(update={"promote": "best_round"})
    # `final`: the last round (KL within budget but gold below round 1) is the only candidate
    report = build_report(reference, rounds, final=rounds[3], gates=final_only)
    assert report.champion_round == 3 and report.gates is not None and report.gates.passed
    # `best_round`: round 2 has the most gold but overran the KL budget; round 1 beats round 3
    report = build_report(reference, rounds, final=rounds[3], gates=best)
    assert report.champion_round == 1 and report.gates is not None and report.gates.passed
    assert any(line.startswith("PASS max_kl") and "4.9000" in line for line in report.gates.checked)
    assert "champion: round 1" in report_markdown(report)
    assert "## Samples (champion, round 1 vs reference)" in report_markdown(report)
    assert "round one's answer" in report_markdown(report)
    # nothing passes: no champion, and the reasons are the final policy's
    strict = best.model_copy(update={"max_kl": 4.0})
    report = build_report(reference, rounds, final=rounds[3], gates=strict)
    assert report.champion_round is None and report.gates is not None and not report.gates.passed
    assert report.gates.reasons == ["max_kl: exact KL 5.5000 vs budget 4.0000 nats"]
    # the final policy fails under `final` even though an earlier round would pass
    report = build_report(reference, {1: rounds[1], 2: rounds[2]}, final=rounds[2], gates=final_only)
    assert report.champion_round is None and not report.gates.passed
    # no gates: the final policy's round
    assert build_report(reference, rounds, final=rounds[3]).champion_round == 3


# ---- plots ----------------------------------------------------------------------------------
def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_write_small_png_files(tmp_path: Path) -> None:
    report = build_report(
        ev(0.0, 0.1, se=0.02), {1: ev(0.5, 0.3, 1.0, 0.02), 2: ev(1.0, 0.2, 4.0, 0.02)}
    )
    over = plot_overoptimisation(report, tmp_path / "plots" / "overopt.png")
    history = [
        {"objective/scores": 0.1 * i, "objective/kl": 0.05 * i, "lr": 1e-5} for i in range(20)
    ]
    curves = plot_training_curves(history, tmp_path / "curves.png", round_starts=[11])
    for path in (over, curves):
        width, height = png_size(path)
        assert 300 <= width <= 1200 and 200 <= height <= 1200, (width, height)
        assert path.stat().st_size > 5_000
    with pytest.raises(ValueError, match="none of the keys"):
        plot_training_curves(history, tmp_path / "none.png", keys=("missing/key",))
