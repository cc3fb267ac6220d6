"""People in the loop: label preference pairs in the Prefect UI while the flow waits.

The pairs are sampled once (a cached task) and written as an unlabelled JSONL. The flow then
pauses with `pause_flow_run(wait_for_input=...)` once per batch of pairs; the Prefect UI shows
the pairs in the form's description and one a/b/skip choice per pair. Submitted labels are
appended to a label file, so a flow that timed out or crashed resumes at the first unlabelled
batch. The label file is the same format `label_file` sources import, so labelling can also
be done outside Prefect: fill the file's "preferred" fields and point a label_file source at it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from prefect import pause_flow_run, task
from prefect.input import RunInput
from pydantic import create_model

from flows.caching import key_from_parameters
from flows.refs import ReferenceRef
from flows.stages.common import logger, placement, stage_dir, write_prompt_file
from ppo_core.config import DeviceConfig
from ppo_core.data.config import HumanPreferenceSource, PromptConfig
from ppo_core.data.labelers import export_unlabeled, sample_response_groups
from ppo_core.data.prompts import load_prompts, split_prompts
from ppo_core.lm.models import load_causal_lm, load_tokenizer

Choice = Literal["a", "b", "skip"]


@task(name="sample_pairs_for_labelling", cache_key_fn=key_from_parameters, persist_result=True)
def sample_pairs_for_labelling(
    key: str, source: HumanPreferenceSource, prompt_cfg: PromptConfig, device: DeviceConfig, reference: ReferenceRef,
    work_dir: str,
) -> str:
    """Sample k responses per training prompt from the reference and export the unlabelled pairs."""
    folder = stage_dir(work_dir, "sample_pairs_for_labelling", key)
    train, _ = split_prompts(load_prompts(prompt_cfg), prompt_cfg.heldout_fraction)
    prompts = train[: source.n_prompts] if source.n_prompts else train
    tokenizer = load_tokenizer(reference.path)
    policy = placement(device).freeze(load_causal_lm(reference.path))
    groups = sample_response_groups(
        policy, tokenizer, prompts, prompt_cfg, source.responses_per_prompt, source.sampling, source.batch_size, 0
    )
    write_prompt_file(folder / "prompts.json", prompts)
    path = folder / "unlabelled.jsonl"
    n = export_unlabeled(groups, path)
    logger().info("%d pairs to label in %s", n, path)
    return str(path)


def _form(batch: list[dict[str, Any]]) -> type[RunInput]:
    fields = {f"pair_{i + 1}": (Choice, "skip") for i in range(len(batch))}
    return create_model("PreferenceLabels", __base__=RunInput, **fields)


def _description(batch: list[dict[str, Any]], index: int, total: int) -> str:
    lines = [f"## Preference labels, form {index + 1} of {total}", "", "Pick the better response (a or b) for each pair.", ""]
    for i, item in enumerate(batch, start=1):
        lines += [f"### pair_{i}", f"**Prompt:** {item['prompt']}", "", f"**a:** {item['a']}", "", f"**b:** {item['b']}", ""]
    return "\n".join(lines)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def collect_human_labels(unlabelled: str, pairs_per_form: int, timeout: int) -> str:
    """Pause the running flow for each unlabelled batch; return the label file's path."""
    pairs = _read_jsonl(Path(unlabelled))
    labels_path = Path(unlabelled).with_name("labels.jsonl")
    done = {item["id"] for item in _read_jsonl(labels_path)}
    batches = [pairs[i : i + pairs_per_form] for i in range(0, len(pairs), pairs_per_form)]
    for index, batch in enumerate(batches):
        if all(item["id"] in done for item in batch):
            continue
        form = _form(batch)
        answer = pause_flow_run(
            wait_for_input=form.with_initial_data(description=_description(batch, index, len(batches))),
            timeout=timeout,
            key=f"labels-{Path(unlabelled).parent.name.rsplit('-', 1)[-1][:16]}-{index}",  # a-z0-9- only
        )
        with labels_path.open("a", encoding="utf-8") as handle:
            for i, item in enumerate(batch, start=1):
                handle.write(json.dumps({**item, "preferred": getattr(answer, f"pair_{i}")}, ensure_ascii=False) + "\n")
    labels_path.touch()
    return str(labels_path)
