"""Fault-injection hooks for resume tests and drills.

RLHF_FAIL_AT="ppo_round:R:I" makes PPO round R raise right after its I-th iteration (counted
within the round) has been checkpointed, as a crash at that moment would. RLHF_KILL_AT=POINT
SIGKILLs the process at a named point (`kill_point`), as a power cut or OOM killer would:
tracking_store (mlflow.db built, not yet renamed in), register (a model logged, not yet
registered), ppo_round_R:I (round R's I-th iteration done, checkpointed when due), evaluate
(the reference evaluated, no policy yet), after:STAGE (STAGE finished, e.g. after:ppo_round_1
is between rounds).
Unset, each costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "RLHF_FAIL_AT"
KILL_ENV = "RLHF_KILL_AT"


class InjectedFailure(RuntimeError):
    """Raised by the hook; never by real work."""


def maybe_fail(stage: str, round_number: int, local_iteration: int) -> None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return
    name, rnd, it = [*spec.split(":"), "", "", ""][:3]
    if name == stage and rnd == str(round_number) and it == str(local_iteration):
        raise InjectedFailure(f"{ENV}={spec}: injected failure in {stage} round {round_number} after iteration {local_iteration}")


def kill_point(point: str) -> None:
    """SIGKILL this process when RLHF_KILL_AT names `point` (no cleanup, no exception); a
    process-group leader (a job started from a shell) takes its whole group with it, as
    `kill -9 -PGID` would, so helpers such as Prefect's ephemeral API server die too."""
    if os.environ.get(KILL_ENV) != point:
        return
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
