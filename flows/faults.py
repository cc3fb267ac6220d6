"""A fault-injection hook for resume tests and drills.

RLHF_FAIL_AT="ppo_round:R:I" makes PPO round R raise right after its I-th iteration (counted
within the round) has been checkpointed, as a crash at that moment would. Unset, it costs one
environment lookup per iteration.
"""

from __future__ import annotations

import os

ENV = "RLHF_FAIL_AT"


class InjectedFailure(RuntimeError):
    """Raised by the hook; never by real work."""


def maybe_fail(stage: str, round_number: int, local_iteration: int) -> None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return
    name, rnd, it = [*spec.split(":"), "", "", ""][:3]
    if name == stage and rnd == str(round_number) and it == str(local_iteration):
        raise InjectedFailure(f"{ENV}={spec}: injected failure in {stage} round {round_number} after iteration {local_iteration}")
