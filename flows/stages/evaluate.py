"""Stage: evaluate every round and the final policy on held-out prompts; promote the champion.

Held-out prompts come from the preference stage's split, so they were never seen by
preference collection or PPO. The reference is sampled once and every round is compared
against the same reference responses.
"""

from __future__ import annotations

import time

import mlflow
from prefect import task
from prefect.artifacts import create_markdown_artifact

from flows.caching import key_from_parameters, sha256_file
from flows.faults import kill_point
from flows.refs import EvalRef, PolicyCheckpoint, PreferenceSet, ReferenceRef, RewardModelRef
from flows.registration import register_policy
from flows.registry import set_alias
from flows.runtime import release_free_heap
from flows.stages.common import logger, placement, read_prompt_file, stage_dir
from flows.tracking import TrackingContext, stage_run
from ppo_core.config import DeviceConfig
from ppo_core.data.config import PromptConfig
from ppo_core.data.labelers import load_gold_scorer
from ppo_core.data.prompts import encode_prompts
from ppo_core.eval.config import EvaluationConfig
from ppo_core.eval.evaluate import HeldOut, PolicyEval, evaluate_policy, evaluate_reference
from ppo_core.eval.markdown import report_markdown
from ppo_core.eval.plots import plot_overoptimisation
from ppo_core.eval.report import EvalReport, build_report
from ppo_core.lm.models import load_causal_lm, load_tokenizer
from ppo_core.reward.model import RewardModel


def _log_eval(label: str, result: PolicyEval, step: int) -> None:
    values = {
        "kl_exact": result.kl_exact, "kl_k1": result.kl_k1, "kl_k3": result.kl_k3,
        "proxy_reward": result.proxy_reward, "gold_reward": result.gold_reward,
        "win_rate_gold": result.win_rate_gold, "win_rate_proxy": result.win_rate_proxy,
        "gold_reward_se": result.gold_reward_se, "gold_gain_se": result.gold_gain_se,
        "response_length": result.response_length, "eos_rate": result.eos_rate,
    }
    mlflow.log_metrics({f"{label}/{k}": v for k, v in values.items() if v is not None}, step=step)


def _headline(report: EvalReport) -> dict[str, float | None]:
    final = report.final or report.reference
    champion = report.rounds.get(report.champion_round) if report.champion_round is not None else None
    return {
        "champion_gold": champion.gold_reward if champion else None,
        "champion_kl_exact": champion.kl_exact if champion else None,
        "reference_gold": report.reference.gold_reward,
        "final_gold": final.gold_reward,
        "reference_proxy": report.reference.proxy_reward,
        "final_proxy": final.proxy_reward,
        "gold_gain_se": final.gold_gain_se,
        "kl_exact": final.kl_exact,
        "win_rate_gold": final.win_rate_gold,
        "win_rate_proxy": final.win_rate_proxy,
    }


def _promote(
    ckpt: PolicyCheckpoint, tracking: TrackingContext, prefs: PreferenceSet, reward: RewardModelRef, reference: ReferenceRef
) -> None:
    """Alias the promoted round's policy `champion`; a round before the last was not registered
    by its PPO stage, so it is registered here (a version per distinct sha256, never twice)."""
    if ckpt.registered_name and ckpt.version:
        set_alias(tracking.uri, ckpt.registered_name, ckpt.version, "champion")
    else:
        register_policy(ckpt, tracking, prefs, reward, reference, aliases=("champion",))


@task(name="evaluate", tags=["gpu"], cache_key_fn=key_from_parameters, persist_result=True)
def evaluate(
    key: str,
    evaluation: EvaluationConfig,
    prompts: PromptConfig,
    device: DeviceConfig,
    reference: ReferenceRef,
    reward: RewardModelRef,
    prefs: PreferenceSet,
    policies: list[PolicyCheckpoint],
    work_dir: str,
    tracking: TrackingContext,
) -> EvalRef:
    start = time.perf_counter()
    log = logger()
    cfg = evaluation
    where = placement(device)
    folder = stage_dir(work_dir, "evaluate", key)
    texts = read_prompt_file(prefs.heldout_prompts_path)[: cfg.n_prompts]
    tokenizer = load_tokenizer(reference.path)
    ids = encode_prompts(tokenizer, texts, prompts)
    ref_model = where.freeze(load_causal_lm(reference.path))
    rm = where.freeze(RewardModel.from_pretrained(reward.path))
    gold = load_gold_scorer(cfg.gold_scorer) if cfg.gold_scorer else None
    held = HeldOut(
        tokenizer, texts, ids, cfg.sampling, rm.score, gold,
        batch_size=cfg.batch_size, n_samples=cfg.n_samples_shown, samples_per_prompt=cfg.samples_per_prompt,
    )
    log.info("evaluating the reference on %d held-out prompts x %d", len(texts), cfg.samples_per_prompt)
    baseline, ref_sample = evaluate_reference(ref_model, held)
    kill_point("evaluate")
    rounds: dict[int, PolicyEval] = {}
    chosen = policies if cfg.per_round else policies[-1:]
    for ckpt in chosen:
        log.info("evaluating round %d", ckpt.round)
        policy = where.freeze(load_causal_lm(ckpt.path))
        rounds[ckpt.round] = evaluate_policy(policy, ref_model, held, ref_responses=ref_sample)
        del policy
        release_free_heap()  # the round's weights, before the next round's load
    report = build_report(baseline, rounds, final=rounds[policies[-1].round], gates=cfg.gates)
    report_path = folder / "report.json"
    report_path.write_text(report.model_dump_json(indent=2))
    plot = plot_overoptimisation(report, folder / "overoptimisation.png")
    markdown = report_markdown(report)
    champion = report.gates is None or report.gates.passed
    promoted = next((p for p in policies if p.round == report.champion_round), None) if champion else None
    result = EvalRef(
        path=str(report_path), sha256=sha256_file(report_path), champion=champion, champion_round=report.champion_round,
        gate_reasons=report.gates.reasons if report.gates else [], headline=_headline(report), plot_path=str(plot),
    )
    with stage_run(tracking, "evaluate", {"rlhf.champion": str(champion)}) as run_id:
        result.mlflow_run_id = run_id
        _log_eval("reference", baseline, 0)
        for rnd, ev in rounds.items():
            _log_eval("policy", ev, rnd)
        mlflow.log_metrics({k: v for k, v in result.headline.items() if v is not None})
        mlflow.log_metric("reward_hacking", float(report.reward_hacking))
        mlflow.log_artifact(str(report_path))
        mlflow.log_artifact(str(plot), artifact_path="plots")
        mlflow.log_text(markdown, "report.md")
        if promoted is not None and tracking.register_models:
            _promote(promoted, tracking, prefs, reward, reference)
            result.champion_model_uri = promoted.model_uri
        result.seconds = time.perf_counter() - start
        mlflow.log_metric("seconds", result.seconds)  # the stage's wall time (its MLflow run opens late)
    create_markdown_artifact(markdown=markdown, key=f"{tracking.pipeline}-evaluation", description="RLHF evaluation")
    log.info("evaluation: %s; champion=%s %s (%.1fs)", result.headline, champion, result.gate_reasons, result.seconds)
    return result

