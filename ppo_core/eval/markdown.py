"""The evaluation report as markdown (for a Prefect markdown artifact or a README note)."""

from __future__ import annotations

from ppo_core.eval.evaluate import EvalSample, PolicyEval
from ppo_core.eval.report import EvalReport

MAX_CELL = 160


def _num(value: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if value is None else fmt.format(value)


def _cell(text: str | None) -> str:
    """Table-safe text: no pipes or newlines, long responses shortened."""
    if text is None:
        return "–"
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= MAX_CELL else flat[: MAX_CELL - 1] + "…"


def _pm(value: float | None, se: float | None, fmt: str = "{:.3f}") -> str:
    return _num(value, fmt) if value is None or se is None else f"{fmt.format(value)} ± {se:.3f}"


def _gain(e: PolicyEval, ref: PolicyEval) -> str:
    if e is ref or e.gold_reward is None or ref.gold_reward is None:
        return "–"
    return _pm(e.gold_reward - ref.gold_reward, e.gold_gain_se, "{:+.3f}")


def _row(label: str, e: PolicyEval, ref: PolicyEval) -> str:
    cells = [
        label,
        _num(e.kl_exact),
        _num(e.kl_k1),
        _num(e.kl_k3),
        _num(e.proxy_reward),
        _pm(e.gold_reward, e.gold_reward_se),
        _gain(e, ref),
        _num(e.win_rate_proxy, "{:.2f}"),
        _num(e.win_rate_gold, "{:.2f}"),
        _num(e.response_length, "{:.1f}"),
        _num(e.eos_rate, "{:.2f}"),
        str(e.n) if e.samples_per_prompt == 1 else f"{e.n} x {e.samples_per_prompt}",
    ]
    return "| " + " | ".join(cells) + " |"


def rounds_table(report: EvalReport) -> str:
    header = (
        "| round | KL exact | KL k1 | KL k3 | proxy | gold ± SE | gold gain ± SE | win (proxy) "
        "| win (gold) | length | EOS rate | prompts |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    ref = report.reference
    rows = [_row("reference", ref, ref)]
    for number, e in sorted(report.rounds.items()):
        mark = " (best)" if number == report.best_round else ""
        rows.append(_row(f"{number}{mark}", e, ref))
    if report.final is not None and report.final not in report.rounds.values():
        rows.append(_row("final", report.final, ref))
    return "\n".join([header, *rows])


def samples_table(samples: list[EvalSample]) -> str:
    lines = [
        "| prompt | policy response | proxy / gold | reference response | proxy / gold |",
        "|---|---|---|---|---|",
    ]
    for s in samples:
        lines.append(
            f"| {_cell(s.prompt)} | {_cell(s.response)} | {_num(s.proxy, '{:.2f}')} / {_num(s.gold, '{:.2f}')} "
            f"| {_cell(s.reference_response)} | {_num(s.reference_proxy, '{:.2f}')} / "
            f"{_num(s.reference_gold, '{:.2f}')} |"
        )
    return "\n".join(lines)


def report_markdown(report: EvalReport) -> str:
    """Summary: verdicts first, then the per-round table, then side-by-side samples."""
    parts = ["# Evaluation report", ""]
    hacking = "**yes**" if report.reward_hacking else "no"
    parts.append(f"- Reward hacking: {hacking} ({report.reward_hacking_reason or 'not checked'})")
    best = "–" if report.best_round is None else str(report.best_round)
    parts.append(
        f"- Best round (by {'gold' if report.reference.gold_reward is not None else 'proxy'}): {best}"
    )
    if report.gates is not None:
        verdict = "passed" if report.gates.passed else "**failed**"
        promoted = "none" if report.champion_round is None else f"round {report.champion_round}"
        parts.append(f"- Promotion gates: {verdict}; champion: {promoted}")
        parts += [f"  - {line}" for line in report.gates.checked]
    parts += [
        "",
        "KL in nats per sequence (mean over responses); win rates against the reference's responses, "
        "ties 0.5; standard errors over prompts, the gain's paired by prompt.",
        "",
    ]
    parts += [rounds_table(report), ""]
    shown, label = report.final, "final policy"
    if report.champion_round is not None and report.final != report.rounds[report.champion_round]:
        shown, label = report.rounds[report.champion_round], f"champion, round {report.champion_round}"
    elif shown is None and report.best_round is not None:
        shown, label = report.rounds[report.best_round], f"round {report.best_round}"
    if shown is not None and shown.samples:
        parts += [f"## Samples ({label} vs reference)", "", samples_table(shown.samples), ""]
    return "\n".join(parts)
