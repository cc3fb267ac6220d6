"""The run summary people read first: stages, cached or run, durations, headline numbers, links."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Any

from flows.config import PipelineConfig
from flows.tracking import TrackingContext


@dataclass
class StageRecord:
    label: str
    cached: bool
    seconds: float
    headline: dict[str, Any]
    result: Any
    memory: dict[str, float] = field(default_factory=dict)
    """Peaks of this process while the stage ran (ppo_core.lm.peak_memory.PeakMemory)."""
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds the stage took in user and kernel mode (`CpuTime`)."""


class CpuTime:
    """User and system CPU seconds since `start()` of this process and of the child processes
    it waited for (torchrun ranks): the system share is the kernel's work for the stage, mostly
    zero-filling freshly mapped memory (flows.runtime)."""

    def start(self) -> CpuTime:
        self.at = self._now()
        return self

    @staticmethod
    def _now() -> tuple[float, float]:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime

    def read(self) -> dict[str, float]:
        (user0, sys0), (user1, sys1) = self.at, self._now()
        return {"user_s": user1 - user0, "sys_s": sys1 - sys0}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _peaks(memory: dict[str, float]) -> str:
    rss = f"{memory['peak_rss_mib']:,.0f}" if "peak_rss_mib" in memory else "-"
    return f"{rss} (CUDA {memory['peak_cuda_mib']:,.0f})" if "peak_cuda_mib" in memory else rss


def _cpu(cpu: dict[str, float]) -> str:
    return f"{cpu['user_s']:.0f} / {cpu['sys_s']:.0f}" if cpu else "-"


def summary_markdown(cfg: PipelineConfig, ctx: TrackingContext, records: list[StageRecord], failed: bool) -> str:
    lines = [
        f"# RLHF pipeline `{cfg.name}` — {'FAILED' if failed else 'finished'}",
        "",
        "| stage | status | seconds | CPU user / sys s | peak RSS MiB | headline |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in records:
        head = ", ".join(f"{k}={_fmt(v)}" for k, v in r.headline.items())
        lines.append(f"| {r.label} | {'Cached' if r.cached else 'Ran'} | {r.seconds:.1f} | {_cpu(r.cpu)} | {_peaks(r.memory)} | {head} |")
    lines += ["", "Peak memory is this process's (torchrun ranks and Ray workers are other processes); CPU "
              "time is this process's and its finished torchrun ranks'."]
    models = [(r.label, getattr(r.result, "model_uri", None)) for r in records if getattr(r.result, "model_uri", None)]
    if models:
        lines += ["", "**Registered models**", ""] + [f"- {label}: `{uri}`" for label, uri in models]
    plots = [str(r.result.plot_path) for r in records if getattr(r.result, "plot_path", None)]
    if plots:
        lines += ["", "**Plots** (also in the MLflow runs)", ""] + [f"- `{p}`" for p in plots]
    lines += [
        "",
        f"MLflow: `{ctx.uri}` (experiment id {ctx.experiment_id}, parent run `{ctx.parent_run_id}`);"
        f" browse with `mlflow ui --backend-store-uri {ctx.uri}`.",
    ]
    return "\n".join(lines) + "\n"
